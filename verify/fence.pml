/*
 * symmsync's epoch fence, as the code implements it (symmsync/language.py: publish, pending,
 * wait, fence; symmsync/fence.py: Fence.fence / arrive / wait; symmsync/buffer.py: SignalLayout),
 * together with its user's payload protocol (tests/test_fence.py: stamps double-buffered by
 * epoch parity). One model; every configuration and every bug variant is a set of -D flags
 * (verify/check.py lists them; verify/README.md maps each construct to the code).
 *
 * Configuration:
 *   VS=n           members per view (2 or 3)
 *   NV=n           views or channels running at once (1 or 2)
 *   F=n            fences each member runs on each view/channel
 *   DISJOINT       NV views over disjoint ranks (rank = v*VS + i), each with the same cell
 *                  offset (as TP x PCP views get); without it, NV channels of one view over
 *                  ranks 0..VS-1, each channel with its own cell
 *   SPLIT          arrive() then wait(): the wait reads the target epoch from the epoch word
 *   TMODE=0        wait blocks until it succeeds (no clock): checks deadlock freedom
 *   TMODE=1        wait may time out only when no process can move (Spin's `timeout`)
 *   TMODE=2        wait may time out at any moment (an arbitrary clock): safety only
 *   CRASH          one rank (any, or none) may stop for good at any point
 * Bug variants (each must yield a counterexample):
 *   BUG_EQ         wait compares slot == e instead of slot >= e
 *   BUG_EARLY      publish before the payload stores
 *   BUG_SINGLE     one payload buffer instead of two (no epoch parity)
 *   BUG_RELAXED    publish without release: earlier stores stay in flight
 *   BUG_SHARED     all channels share one signal cell
 *   BUG_OPEN       a timed-out wait goes on as if it had succeeded (fails open)
 */

#ifndef VS
#define VS 2
#endif
#ifndef NV
#define NV 1
#endif
#ifndef F
#define F 4
#endif
#ifndef TMODE
#define TMODE 0
#endif

#ifdef DISJOINT
#define NG (NV * VS)              /* ranks in the job */
#define G(v, i) ((v) * VS + (i))  /* the rank of member i of view v */
#define NCELL 1                   /* every view's cell sits at the same offset ... */
#define CELL(v) 0                 /* ... of its own members' memory */
#else
#define NG VS
#define G(v, i) (i)
#ifdef BUG_SHARED
#define NCELL 1
#define CELL(v) 0
#else
#define NCELL NV
#define CELL(v) (v)               /* SignalLayout.cell(region, channel): one cell per channel */
#endif
#endif

#ifdef BUG_EQ
#define REACHED(x, e) ((x) == (e))
#else
#define REACHED(x, e) ((x) >= (e))  /* pending(): v < epoch counts as not arrived */
#endif

#ifdef BUG_SINGLE
#define BUF(k) 0
#else
#define BUF(k) ((k) % 2)            /* the payload half of fence k (epoch parity) */
#endif

/* ---- shared memory; every counter fits a byte since F is small ---- */
/* cell c in rank g's memory: slot[j] counts how many times member j published to g */
byte slot[NCELL * NG * VS];
#define SLOT(c, g, j) slot[((c) * NG + (g)) * VS + (j)]
/* cell c in rank g's memory: the epoch word, g's own counter */
byte ep[NCELL * NG];
#define EPOCH(c, g) ep[(c) * NG + (g)]
/* the payload of view v in member p's memory: half b, the stamp member j wrote there (0: none) */
byte pay[NV * VS * 2 * VS];
#define PAY(v, p, b, j) pay[(((v) * VS + (p)) * 2 + (b)) * VS + (j)]
/* weak memory: member i's last store to PAY(v, p, b, i) that p cannot see yet (0: none) */
byte pend[NV * VS * VS * 2];
#define PEND(v, i, p, b) pend[(((v) * VS + (i)) * VS + (p)) * 2 + (b)]

/* ---- ghost state: what the specification talks about, never read by the protocol ---- */
/* how many of member j's publishes on view v have sent their lane to member p */
byte sent[NV * VS * VS];
#define SENT(v, j, p) sent[((v) * VS + (j)) * VS + (p)]
bit dead[NG];                 /* the rank stopped (CRASH) */
bit gaveup[NV * VS];          /* the member's wait timed out; it never goes on */
#define STOPPED(v, j) (dead[G(v, j)] || gaveup[(v) * VS + (j)])

/* every other member's slot of cell c in rank g's memory has reached e (one poll of pending()) */
#if VS == 2
#define ALL_REACHED(c, g, i, e) REACHED(SLOT(c, g, 1 - (i)), e)
#define MISSING_STOPPED(v, c, g, i, e) (SLOT(c, g, 1 - (i)) < (e) && STOPPED(v, 1 - (i)))
#define ALL_SENT(v, i, k) (SENT(v, 1 - (i), i) >= (k))
#else
#define ALL_REACHED(c, g, i, e) \
    (REACHED(SLOT(c, g, ((i) + 1) % 3), e) && REACHED(SLOT(c, g, ((i) + 2) % 3), e))
#define MISSING_STOPPED(v, c, g, i, e) \
    ((SLOT(c, g, ((i) + 1) % 3) < (e) && STOPPED(v, ((i) + 1) % 3)) || \
     (SLOT(c, g, ((i) + 2) % 3) < (e) && STOPPED(v, ((i) + 2) % 3)))
#define ALL_SENT(v, i, k) (SENT(v, ((i) + 1) % 3, i) >= (k) && SENT(v, ((i) + 2) % 3, i) >= (k))
#endif

/* publish(), one lane: red.release.sys.add(&mem[p].cell.slot[me], 1). The release first makes
 * every earlier store of this member visible (flushes its in-flight stores); relaxed does not. */
#ifdef BUG_RELAXED
#define RELEASE(v, i) skip
#else
#define RELEASE(v, i) \
    for (q : 0 .. VS - 1) { PEND_TO_PAY(v, i, q, 0); PEND_TO_PAY(v, i, q, 1) }
#endif
#define PEND_TO_PAY(v, i, p, b) \
    if :: PEND(v, i, p, b) != 0 -> PAY(v, p, b, i) = PEND(v, i, p, b); PEND(v, i, p, b) = 0 \
       :: else -> skip fi
#define LANE(p) \
    d_step { RELEASE(v, i); q = 0; SLOT(c, G(v, p), i)++; SENT(v, i, p)++ }

/* One member of one view (or of one channel): F rounds of stamp, fence, check. */
proctype Member(byte v; byte i) {
    byte c = CELL(v);
    byte g = G(v, i);
    byte k = 0;   /* the user's fence counter (tests/test_fence.py: the loop's e) */
    byte e = 0;   /* the epoch the wait targets */
    byte q = 0;
#ifdef CRASH
    {
#endif
    do
    :: k < F ->
        k++;
#ifndef BUG_EARLY
        /* payload: stamp k into half BUF(k), slot i, of every member's payload (stamp_kernel);
         * own memory directly, peers' through in-flight stores */
        d_step {
            for (q : 0 .. VS - 1) {
                if :: q == i -> PAY(v, i, BUF(k), i) = k
                   :: else -> PEND(v, i, q, BUF(k)) = k fi
            }
            q = 0
        }
#endif
        /* publish(): one reduction per other member (thread 0 issues them; they land in any order) */
#if VS == 2
        LANE(1 - i);
#else
        if
        :: LANE((i + 1) % 3); LANE((i + 2) % 3)
        :: LANE((i + 2) % 3); LANE((i + 1) % 3)
        fi;
#endif
        /* ... then _advance_epoch(): e = ++epoch */
        d_step { EPOCH(c, g) = EPOCH(c, g) + 1; e = EPOCH(c, g) }
#ifdef BUG_EARLY
        d_step {
            for (q : 0 .. VS - 1) {
                if :: q == i -> PAY(v, i, BUF(k), i) = k
                   :: else -> PEND(v, i, q, BUF(k)) = k fi
            }
            q = 0
        }
#endif
#ifdef SPLIT
        /* Fence.arrive() returned; Fence.wait() reads its target from the epoch word */
        e = EPOCH(c, g);
#endif
        /* wait(e): bounded poll of pending(e) */
        if
        :: ALL_REACHED(c, g, i, e) -> skip
#if TMODE == 1
        :: atomic { timeout ->
               /* fires only when nothing can move: some member this wait lacks has stopped */
               assert(MISSING_STOPPED(v, c, g, i, e));
               gaveup[v * VS + i] = 1 };
           goto stop
#elif TMODE == 2
#ifdef BUG_OPEN
        :: skip   /* the clock ran out, and the caller reads the payload anyway */
#else
        :: gaveup[v * VS + i] = 1; goto stop
#endif
#endif
        fi;
        /* wait() returned 0: every peer's k-th publish on this view has reached this member
         * (and the epoch waited for is the k-th: epochs count fences) ... */
#ifdef BUG_SHARED
        assert(ALL_SENT(v, i, k));
#else
        d_step { assert(ALL_SENT(v, i, k)); assert(e == k) }
#endif
        /* ... and every peer's stamp k is visible in this fence's half (_check) */
        d_step {
            for (q : 0 .. VS - 1) { assert(PAY(v, i, BUF(k), q) == k) }
            q = 0
        }
    :: else -> break
    od;
    /* finished all F fences */
    assert(k == F);
#ifndef BUG_SHARED
    assert(EPOCH(c, g) == F);
#endif
#ifdef CRASH
    } unless { dead[g] };
#endif
stop:
    skip
}

/* In-flight stores of member i to member p become visible in any order, at any time. */
proctype Memory(byte v; byte i; byte p) {
end:
    do
    :: d_step { PEND(v, i, p, 0) != 0 -> PAY(v, p, 0, i) = PEND(v, i, p, 0); PEND(v, i, p, 0) = 0 }
    :: d_step { PEND(v, i, p, 1) != 0 -> PAY(v, p, 1, i) = PEND(v, i, p, 1); PEND(v, i, p, 1) = 0 }
    od
}

#ifdef CRASH
/* At most one rank stops for good, at any point of its run (or none does). */
proctype Crasher() {
    byte r;
    select (r : 0 .. NG);   /* r == NG: nobody crashes */
    if
    :: r < NG -> dead[r] = 1
    :: else -> skip
    fi
}
#endif

init {
    byte v, i, p;
    atomic {
        for (v : 0 .. NV - 1) {
            for (i : 0 .. VS - 1) {
                run Member(v, i);
                for (p : 0 .. VS - 1) {
                    if :: p != i -> run Memory(v, i, p) :: else -> skip fi
                }
            }
        }
#ifdef CRASH
        run Crasher();
#endif
    }
}
