/*
 * Models:
 *   symmsync/moe/protocol.py: parity, notify (header with the refusal, signal), check (the
 *     wait for every member's signal count n + 1, the header check), finish (the step counted);
 *     the header is the consumer kit's call header (symmsync/language/calls.py: post_call pushes
 *     it into every member's headers of parity n % 2, check_call compares them)
 *   symmsync/moe/kernels.py: dispatch_send / combine_send (the rows, then the last program's
 *     notify), dispatch_read / combine_reduce (check, then the read): one step counter and one
 *     signal slot for both kinds of step, a region per kind and parity; one program per launch
 *     (the arrival counter that makes a launch's last program notify is the fence's `arrive`,
 *     whose argument language/core.py gives)
 *   (on symmsync/language/signals.py: signal, ADD with release; wait_signal GE, acquire, as
 *   verify/signals.pml models them)
 *
 * The dispatcher's buffer reuse and its step check: every member runs S steps back to back, with
 * no host barrier; step k of member i is a dispatch or a combine (KIND(i, k)). Step k of member i:
 * (1) store its rows into every member r's region of the step's kind from i, of parity k % 2
 * (plain stores: they land at any time, or at i's next release); (2) store its header (k, kind)
 * into every member's headers from i of parity k % 2 (plain stores too), signal every member (a
 * release add: every earlier store of i lands first), then a counted wait for every member's
 * signal; then compare every member's header with its own: one that differs fails the step (a
 * mismatch: nothing is read; every member, having every header, fails the same step, and the
 * host then fails the dispatcher, aborting the view: modelled as the abort, which also ends the
 * waits of a member that had not checked yet); (3) read its own
 * regions of the kind and parity, one sender at a time, each read asserting that the rows are
 * step k's: neither stale (not landed yet, or another kind's step) nor overwritten (a faster
 * member's later step wrote them while this one still reads). verify/check.py lists the
 * configurations.
 *
 * Configuration:
 *   N=n            members (2 or 3)
 *   S=n            steps each member makes (alternating: dispatch, combine, dispatch, ...)
 *   ONEKIND        every step a dispatch (dispatches with no combine between them)
 *   MISMATCH       member 1 makes the other kind of step at step 2: every member must stop at
 *                  step 2 at the latest, failed or aborted, having read nothing of it
 *   REFUSE         member 1 refuses its step 2 (a bad argument): it sends no rows, its header
 *                  says so; every member reads nothing of step 2 and every member makes all S
 *                  steps, the later ones read right
 * Bug variants (each must yield a counterexample):
 *   BUG_NOPARITY   (with ONEKIND) one region per sender, no parity: a fast member's next step
 *                  overwrites rows a slow member still reads
 *   BUG_NOWAIT     no counted waits: the header check reads a header not landed yet, and a step
 *                  every member made alike fails (without the header check, the rows would be
 *                  read before they land)
 *   BUG_EARLY      the signal before the stores (no release order): the same
 *   BUG_NOHEADER   (with MISMATCH) no header check: a member reads a step the other never made
 *   BUG_NOREFUSE   (with REFUSE) the check blind to a refusal: a member reads rows never sent
 */

#ifndef N
#define N 2
#endif
#ifndef S
#define S 4
#endif
#ifdef BUG_NOPARITY
#define NBUF 1
#else
#define NBUF 2
#endif
#if defined(MISMATCH)
#define KIND(i, k) (((k) + ((i) == 1 && (k) == 2)) % 2)
#elif defined(ONEKIND)
#define KIND(i, k) 0
#else
#define KIND(i, k) ((k) % 2)
#endif
#ifdef REFUSE
#define REFUSES(i, k) ((i) == 1 && (k) == 2)
#else
#define REFUSES(i, k) 0
#endif
/* a header: 2 k + kind + 1, plus 100 when the step is refused */
#define REFUSED_BIT 100

/* rows[r][s][kind][b]: the step that last wrote member r's region of that kind from sender s of
 * parity b (0: none); prows: sender s's store not visible yet */
byte rows[N * N * 4];
byte prows[N * N * 4];
#define RI(r, s, c, b) ((((r) * N + (s)) * 2 + (c)) * 2 + (b))
#define ROWS(r, s, c, b) rows[RI(r, s, c, b)]
#define PROWS(r, s, c, b) prows[RI(r, s, c, b)]
/* hdr[r][s][b]: the header sender s last stored in member r's headers of parity b, 2 k + kind + 1
 * (0: none); phdr: not visible yet */
byte hdr[N * N * 2];
byte phdr[N * N * 2];
#define HI(r, s, b) (((r) * N + (s)) * 2 + (b))
#define HDR(r, s, b) hdr[HI(r, s, b)]
#define PHDR(r, s, b) phdr[HI(r, s, b)]
/* sig[r][s]: what s signalled r on the step slot (ADD 1 per step); base[r][s]: what r's counted
 * waits consumed */
byte sig[N * N];
byte base[N * N];
#define SIG(r, s) sig[(r) * N + (s)]
#define BASE(r, s) base[(r) * N + (s)]
/* a member failed its step and aborted the view: every member's waits end */
bool aborted = false;

#define READ(v) assert((v) >= k); assert((v) <= k)
#define LANDR(r, c, b) if :: PROWS(r, i, c, b) != 0 -> ROWS(r, i, c, b) = PROWS(r, i, c, b); PROWS(r, i, c, b) = 0 :: else -> skip fi
#define LANDH(r, b) if :: PHDR(r, i, b) != 0 -> HDR(r, i, b) = PHDR(r, i, b); PHDR(r, i, b) = 0 :: else -> skip fi
/* the release: every earlier store of member i lands before the add */
#define RELEASE d_step { for (q : 0 .. N - 1) { LANDR(q, 0, 0); LANDR(q, 0, 1); LANDR(q, 1, 0); LANDR(q, 1, 1); LANDH(q, 0); LANDH(q, 1) }; q = 0 }

proctype Member(byte i) {
    byte k = 0;
    byte q = 0;
    byte m = 0;
    byte c = 0;
    bool failed = false;
    bool refused = false;
    do
    :: k < S && !failed && !aborted ->
        k++;
        c = KIND(i, k);
        /* step 1: the send, every receiver's region of the step's kind, parity k % NBUF (none
         * when the step is refused) */
        if
        :: !REFUSES(i, k) -> d_step { for (q : 0 .. N - 1) { PROWS(q, i, c, k % NBUF) = k }; q = 0 }
        :: else -> skip
        fi;
        /* notify: the header first, then the signals to the members in any order */
        d_step { for (q : 0 .. N - 1) { PHDR(q, i, k % 2) = 2 * k + c + 1 + (REFUSES(i, k) -> REFUSED_BIT : 0) }; q = 0 }
        m = 0;
        do
        :: m < N ->
#ifndef BUG_EARLY
            RELEASE;
            SIG(m, i)++;
#else
            SIG(m, i)++;
            RELEASE;
#endif
            m++
        :: else -> break
        od;
#ifndef BUG_NOWAIT
        m = 0;
        do
        :: m < N ->
            if
            :: SIG(i, m) >= BASE(i, m) + 1 -> BASE(i, m)++; m++
            :: aborted -> failed = true; break  /* the wait ends on an abort */
            fi
        :: else -> break
        od;
#endif
        refused = false;
#ifndef BUG_NOHEADER
        m = 0;
        do
        :: !failed && m < N && HDR(i, m, k % 2) % REFUSED_BIT == 2 * k + c + 1 ->
#ifndef BUG_NOREFUSE
            if
            :: HDR(i, m, k % 2) >= REFUSED_BIT -> refused = true
            :: else -> skip
            fi;
#endif
            m++
        :: !failed && m < N && HDR(i, m, k % 2) % REFUSED_BIT != 2 * k + c + 1 -> failed = true; aborted = true; break
        :: else -> break
        od;
#endif
        /* the read, one sender's rows at a time, when the step did not fail and nobody refused */
        m = 0;
        do
        :: !failed && !refused && m < N -> READ(ROWS(i, m, c, k % NBUF)); m++
        :: else -> break
        od
    :: else -> break
    od;
#ifdef MISMATCH
    assert(k <= 2 && (failed || aborted))
#else
    assert(k == S && !failed)
#endif
}

/* Member s's stores in flight become visible one at a time, in any order, at any time. */
#define FLUSHR(r, c, b) :: d_step { (r) < N && PROWS(r, s, c, b) != 0 -> ROWS(r, s, c, b) = PROWS(r, s, c, b); PROWS(r, s, c, b) = 0 }
#define FLUSHH(r, b) :: d_step { (r) < N && PHDR(r, s, b) != 0 -> HDR(r, s, b) = PHDR(r, s, b); PHDR(r, s, b) = 0 }
proctype Memory(byte s) {
end:
    do
    FLUSHR(0, 0, 0) FLUSHR(0, 0, 1) FLUSHR(0, 1, 0) FLUSHR(0, 1, 1)
    FLUSHR(1, 0, 0) FLUSHR(1, 0, 1) FLUSHR(1, 1, 0) FLUSHR(1, 1, 1)
    FLUSHH(0, 0) FLUSHH(0, 1) FLUSHH(1, 0) FLUSHH(1, 1)
#if N > 2
    FLUSHR(2, 0, 0) FLUSHR(2, 0, 1) FLUSHR(2, 1, 0) FLUSHR(2, 1, 1)
    FLUSHH(2, 0) FLUSHH(2, 1)
#endif
    od
}

init {
    byte p;
    atomic {
        for (p : 0 .. N - 1) {
            run Member(p);
            run Memory(p)
        }
    }
}
