/*
 * Models:
 *   symmsync/moe/protocol.py: parity, finished_parity, notify_and_wait
 *   symmsync/moe/kernels.py: dispatch_send (step 1), dispatch_notify (step 2), dispatch_read (step 3);
 *     the combine's three launches are the same protocol on their own slot and step counter
 *   (on symmsync/language/signals.py: signal, ADD with release; wait_count, acquire against a
 *   device-resident base, as verify/signals.pml models them)
 *
 * The dispatcher's buffer reuse: every member runs S steps back to back, with no host barrier.
 * Step k of member i: (1) store its rows into every member r's region from i of parity k % 2
 * (plain stores: they land at any time, or at i's next release); (2) signal every member (a
 * release add: every earlier store of i lands first), then a counted wait for every member's
 * signal; (3) read its own regions of parity k % 2, one sender at a time, each read asserting that
 * the rows are step k's: neither stale (not landed yet) nor overwritten (a faster member's later
 * step wrote them while this one still reads). verify/check.py lists the configurations.
 *
 * Configuration:
 *   N=n            members (2 or 3)
 *   S=n            steps each member makes
 * Bug variants (each must yield a counterexample):
 *   BUG_NOPARITY   one region per sender, no parity: a fast member's next step overwrites rows a
 *                  slow member still reads
 *   BUG_NOWAIT     no counted waits: a member reads rows not yet landed
 *   BUG_EARLY      the signal before the rows' stores (no release order): rows read before they land
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

/* rows[r][s][b]: the step that last wrote member r's region from sender s of parity b (0: none);
 * prows: sender s's store not visible yet */
byte rows[N * N * 2];
byte prows[N * N * 2];
#define ROWS(r, s, b) rows[((r) * N + (s)) * 2 + (b)]
#define PROWS(r, s, b) prows[((r) * N + (s)) * 2 + (b)]
/* sig[r][s]: what s signalled r on the step slot (ADD 1 per step); base[r][s]: what r's counted
 * waits consumed */
byte sig[N * N];
byte base[N * N];
#define SIG(r, s) sig[(r) * N + (s)]
#define BASE(r, s) base[(r) * N + (s)]

#define READ(v) assert((v) >= k); assert((v) <= k)
#define LAND(r, b) if :: PROWS(r, i, b) != 0 -> ROWS(r, i, b) = PROWS(r, i, b); PROWS(r, i, b) = 0 :: else -> skip fi
/* the release: every earlier store of member i lands before the add */
#define RELEASE d_step { for (q : 0 .. N - 1) { LAND(q, 0); LAND(q, 1) }; q = 0 }

proctype Member(byte i) {
    byte k = 0;
    byte q = 0;
    byte m = 0;
    do
    :: k < S ->
        k++;
        /* step 1: dispatch_send, every receiver's region of parity k % NBUF */
        d_step { for (q : 0 .. N - 1) { PROWS(q, i, k % NBUF) = k }; q = 0 }
        /* step 2: notify_and_wait; the signals to the members in any order */
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
        :: m < N -> (SIG(i, m) >= BASE(i, m) + 1); BASE(i, m)++; m++
        :: else -> break
        od;
#endif
        /* step 3: dispatch_read, one sender's rows at a time */
        m = 0;
        do
        :: m < N -> READ(ROWS(i, m, k % NBUF)); m++
        :: else -> break
        od
    :: else -> break
    od;
    assert(k == S)
}

/* Member s's stores in flight become visible one at a time, in any order, at any time. */
#define FLUSH(r, b) :: d_step { (r) < N && PROWS(r, s, b) != 0 -> ROWS(r, s, b) = PROWS(r, s, b); PROWS(r, s, b) = 0 }
proctype Memory(byte s) {
end:
    do
    FLUSH(0, 0) FLUSH(0, 1) FLUSH(1, 0) FLUSH(1, 1)
#if N > 2
    FLUSH(2, 0) FLUSH(2, 1)
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
