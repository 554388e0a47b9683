/*
 * Models:
 *   symmsync/language/signals.py: put_signal, signal, wait_count (its poll, _wait_until)
 *   symmsync/language/core.py: bounded_poll (KIND=VALUE, CMP=GE), scan_members (FLAGGED): the
 *     one poll and abort scan of every wait
 *   symmsync/core/signals.py: Signals (the handle those take)
 *
 * symmsync's point-to-point signals, as those functions implement them (kernels call them as
 * symmsync.language.put_signal, ...), together with the pipelined transfer its tests and tutorial
 * run (tests/core/test_signals.py, examples/07_signals.py): a producer P puts chunk g into tile
 * g % R of a ring in the consumer C's memory and signals C's data slot (put_signal: the stores, a
 * release, an add); C waits for one more data signal (wait_count: acquire loads, relative to its
 * device-resident base), reads the tile and hands it back with a credit signal (signal ADD,
 * release); P waits for one credit before each chunk (C grants R up front). Each kernel runs N
 * chunks and is launched K times with the same arguments (CUDA graph replays): the bases persist
 * in device memory and are never reset. verify/check.py lists the configurations;
 * verify/README.md maps each construct to the code.
 *
 * Configuration:
 *   R=n            tiles in the ring (2 or 3)
 *   N=n            chunks per launch
 *   K=n            launches (replays) of each kernel
 *   ABORT          either rank (or none) aborts at any point between its steps: it sets its
 *                  abort flag at the other (the view's abort, which the signal waits poll) and
 *                  launches nothing more
 * Bug variants (each must yield a counterexample):
 *   BUG_RELAXED    put_signal without the release: the tile's stores may land after the signal
 *   BUG_EQ         the counted wait compares slot - base == count instead of >=
 *   BUG_ABS        the wait compares the slot with the launch's own chunk number (slot >= c + 1,
 *                  no base): right in the first launch, stale in every replay
 *   BUG_NOCREDIT   the producer does not wait for a credit before reusing a tile
 *   BUG_NOFLAG     the waits do not read the abort flags: a peer's abort leaves them spinning
 */

#ifndef R
#define R 2
#endif
#ifndef N
#define N 3
#endif
#ifndef K
#define K 2
#endif

/* ---- shared memory ---- */
byte data;        /* C's inbox slot from P (DATA): chunks signalled */
byte credit;      /* P's inbox slot from C (CREDIT): tiles handed back */
byte dbase;       /* C's base of DATA: what its counted waits consumed (only C writes it) */
byte cbase;       /* P's base of CREDIT (only P writes it) */
byte tile[R];     /* what C can see in each tile: chunk g stores g + 1 */
byte pend[R];     /* P's store into a tile that C cannot see yet (0: none) */
bit pflag;        /* P's abort flag in C's cell */
bit cflag;        /* C's abort flag in P's cell */

/* ---- ghost state ---- */
bit pstop;        /* P stopped (aborted, or its wait saw C's abort) */
bit cstop;
byte reads;       /* chunks C read */

#ifdef BUG_EQ
#define COUNTED(v, b, n) ((v) - (b) == (n))
#else
#define COUNTED(v, b, n) ((v) - (b) >= (n))   /* _wait_until(..., b + count, GE) -> bounded_poll */
#endif

#ifdef BUG_NOFLAG
#define SEES(flag) 0
#else
#define SEES(flag) (flag)                      /* scan_members(FLAGGED) on the slow path */
#endif

/* put_signal's release: every earlier store of P lands before the add becomes visible. */
#ifdef BUG_RELAXED
#define RELEASE(t) skip
#else
#define RELEASE(t) if :: pend[t] != 0 -> tile[t] = pend[t]; pend[t] = 0 :: else -> skip fi
#endif

proctype Producer() {
    byte k = 0;
    byte c = 0;
    byte g = 0;
    do
    :: k < K ->
        c = 0;
        do
        :: c < N ->
#ifdef ABORT
            if
            :: skip
            :: atomic { !cstop -> pflag = 1; pstop = 1 }; goto stop   /* P's host aborts the view */
            fi;
#endif
            g = k * N + c;
#ifndef BUG_NOCREDIT
            /* wait_count(CREDIT, 1): one acquire poll after another; then the base moves */
            if
            :: atomic { COUNTED(credit, cbase, 1) -> cbase = cbase + 1 }
            :: atomic { !COUNTED(credit, cbase, 1) && SEES(cflag) -> pstop = 1 }; goto stop
            fi;
#endif
            pend[g % R] = g + 1;                     /* the tile's stores: in flight */
            d_step { RELEASE(g % R); data = data + 1 }   /* ... the release, the add */
            c++
        :: else -> break
        od;
        k++
    :: else -> break
    od;
stop:
    skip
}

proctype Consumer() {
    byte k = 0;
    byte c = 0;
    byte g = 0;
    credit = credit + R;   /* the host grants every tile before the first launch */
    do
    :: k < K ->
        c = 0;
        do
        :: c < N ->
#ifdef ABORT
            if
            :: skip
            :: atomic { !pstop -> cflag = 1; cstop = 1 }; goto stop
            fi;
#endif
            g = k * N + c;
#ifdef BUG_ABS
#define READY (data >= c + 1)
#define TAKE skip
#else
#define READY COUNTED(data, dbase, 1)
#define TAKE dbase = dbase + 1
#endif
            if
            :: atomic { READY -> TAKE }
            :: atomic { !(READY) && SEES(pflag) -> cstop = 1 }; goto stop
            fi;
            /* the payload oracle: the tile holds chunk g, complete */
            assert(tile[g % R] == g + 1);
            reads++;
            credit = credit + 1;   /* signal(CREDIT, ADD): released after the read */
            c++
        :: else -> break
        od;
        k++
    :: else -> break
    od;
stop:
    skip
}

#ifdef BUG_RELAXED
/* Stores in flight land in any order, at any later moment. */
active proctype Memory() {
end:
    do
    :: atomic { pend[0] != 0 -> tile[0] = pend[0]; pend[0] = 0 }
    :: atomic { pend[1] != 0 -> tile[1] = pend[1]; pend[1] = 0 }
#if R > 2
    :: atomic { pend[2] != 0 -> tile[2] = pend[2]; pend[2] = 0 }
#endif
    od
}
#endif

init {
    atomic { run Producer(); run Consumer() }
    (_nr_pr == 1
#ifdef BUG_RELAXED
        + 1
#endif
    );
    /* every run ends; unless a rank aborted, every chunk was read */
    assert(pstop || cstop || reads == N * K);
}
