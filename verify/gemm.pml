/*
 * Models:
 *   symmsync/gemm/kernels.py: start (program 0: the call header into every member's headers of
 *     parity c % 2, then a release SET of c + 1 on every member's header slot), the stores of a
 *     block of rows (or partial sums) into a peer's region [c % 2][me] and the release SET of
 *     c + 1 on that block's slot, verdict (a wait for every other member's header slot >= c + 1,
 *     then the kit's check_call), wait_block (a block's slot >= c + 1) before each read of a
 *     peer's block; all_gather_matmul and matmul_reduce_scatter follow the same steps (only what
 *     a block holds differs)
 *   (on symmsync/language/signals.py: signal SET with release; wait_signal GE, acquire, as
 *   verify/signals.pml models them; the header is the consumer kit's, symmsync/language/calls.py)
 *
 * Every member makes C calls back to back, with no host barrier. Call k of member i: its
 * header and its blocks go out in either order (program 0 stores and releases the header while
 * other programs store and release blocks); a block's stores are plain (they land at any time,
 * or at the member's next release); then the verdict: a wait for every other member's header
 * release of call k, then a comparison of every member's header with its own: a differing one
 * fails the call (every member sees it; the host fails the consumer, aborting the view:
 * modelled as the abort, which also ends a member's waits), a refused one makes the member
 * read nothing; then, for each other member and each block, a wait for that block's release
 * and a read asserting that the block is call k's: neither stale (not landed, or never sent)
 * nor overwritten (a faster member's next call wrote it while this one still reads).
 * verify/check.py lists the configurations.
 *
 * Configuration:
 *   N=n            members (2 or 3)
 *   C=n            calls each member makes
 *   MISMATCH       member 1's call 2 has other rows (a differing header), and sends one block
 *                  only: every member must stop at call 2, failed or aborted, having read
 *                  nothing of it
 *   REFUSE         member 1 refuses its call 2: it sends no block, its header says so; nobody
 *                  reads call 2 and every member makes all C calls, the later ones read right
 * Bug variants (each must yield a counterexample):
 *   BUG_NOPARITY   one region per sender, no parity: a fast member's next call overwrites a
 *                  block a slow member still reads
 *   BUG_NOWAIT     no block waits: a block read before it lands
 *   BUG_EARLY      a block's signal before its stores (no release order): the same
 *   BUG_NOHEADER   (with REFUSE) no header check: a member waits for a block a refusing member
 *                  never sends
 */

#ifndef N
#define N 2
#endif
#ifndef C
#define C 3
#endif
#define B 2
#ifdef BUG_NOPARITY
#define NBUF 1
#else
#define NBUF 2
#endif
#ifdef MISMATCH
#define DIFFERS(i, k) ((i) == 1 && (k) == 2)
#else
#define DIFFERS(i, k) 0
#endif
#ifdef REFUSE
#define REFUSES(i, k) ((i) == 1 && (k) == 2)
#else
#define REFUSES(i, k) 0
#endif
/* a header: 2 k (+ 1 when its rows differ), plus 100 when the call is refused */
#define REFUSED_BIT 100
#define HEADER(i, k) (2 * (k) + DIFFERS(i, k) + (REFUSES(i, k) -> REFUSED_BIT : 0))
/* the blocks call k of member i sends each member */
#define SENDS(i, k) (REFUSES(i, k) -> 0 : (DIFFERS(i, k) -> 1 : B))

/* blk[r][s][b][j]: the call that last wrote block j of member r's region from sender s, copy b
 * (0: none); pblk: sender s's store not visible yet */
byte blk[N * N * 2 * B];
byte pblk[N * N * 2 * B];
#define BI(r, s, b, j) ((((r) * N + (s)) * 2 + (b)) * B + (j))
#define BLK(r, s, b, j) blk[BI(r, s, b, j)]
#define PBLK(r, s, b, j) pblk[BI(r, s, b, j)]
/* hdr[r][s][b]: the header s last stored in r's headers of parity b; phdr: not visible yet */
byte hdr[N * N * 2];
byte phdr[N * N * 2];
#define HI(r, s, b) (((r) * N + (s)) * 2 + (b))
#define HDR(r, s, b) hdr[HI(r, s, b)]
#define PHDR(r, s, b) phdr[HI(r, s, b)]
/* hsig[r][s], bsig[r][s][j]: what s last SET on r's header slot and block j's slot */
byte hsig[N * N];
byte bsig[N * N * B];
#define HSIG(r, s) hsig[(r) * N + (s)]
#define BSIG(r, s, j) bsig[((r) * N + (s)) * B + (j)]
/* a member failed its call and aborted the view: every member's waits end */
bool aborted = false;

#define READ(v) assert((v) >= k); assert((v) <= k)
#define LANDB(r, b, j) if :: PBLK(r, i, b, j) != 0 -> BLK(r, i, b, j) = PBLK(r, i, b, j); PBLK(r, i, b, j) = 0 :: else -> skip fi
#define LANDH(r, b) if :: PHDR(r, i, b) != 0 -> HDR(r, i, b) = PHDR(r, i, b); PHDR(r, i, b) = 0 :: else -> skip fi
/* the release: every earlier store of member i lands before the signal */
#define RELEASE d_step { for (q : 0 .. N - 1) { LANDB(q, 0, 0); LANDB(q, 0, 1); LANDB(q, 1, 0); LANDB(q, 1, 1); LANDH(q, 0); LANDH(q, 1) }; q = 0 }

proctype Member(byte i) {
    byte k = 0;
    byte q = 0;
    byte m = 0;
    byte j = 0;
    bool headed = false;
    bool failed = false;
    bool refused = false;
    do
    :: k < C && !failed && !aborted ->
        k++;
        headed = false;
        /* the header (program 0) and the blocks (the other programs), in either order */
        j = 0;
        do
        :: !headed ->
            d_step { for (q : 0 .. N - 1) { PHDR(q, i, k % 2) = HEADER(i, k) }; q = 0 };
            RELEASE;
            d_step { for (q : 0 .. N - 1) { HSIG(q, i) = k }; q = 0 };
            headed = true
        :: j < SENDS(i, k) ->
            m = 0;
            do
            :: m < N ->
                if
                :: m != i ->
                    PBLK(m, i, k % NBUF, j) = k;
#ifndef BUG_EARLY
                    RELEASE;
                    BSIG(m, i, j) = k
#else
                    BSIG(m, i, j) = k;
                    RELEASE
#endif
                :: else -> skip
                fi;
                m++
            :: else -> break
            od;
            j++
        :: headed && j >= SENDS(i, k) -> break
        od;
        /* the verdict: every other member's header release, then the comparison */
        m = 0;
        do
        :: m < N && m == i -> m++
        :: m < N && m != i ->
            if
            :: HSIG(i, m) >= k -> m++
            :: aborted -> failed = true; break  /* the wait ends on an abort */
            fi
        :: else -> break
        od;
        refused = REFUSES(i, k);  /* its own words come from its arguments, not its memory */
#ifndef BUG_NOHEADER
        m = 0;
        do
        :: !failed && m < N && m == i -> m++
        :: !failed && m < N && m != i && HDR(i, m, k % 2) % REFUSED_BIT == HEADER(i, k) % REFUSED_BIT ->
            if
            :: HDR(i, m, k % 2) >= REFUSED_BIT -> refused = true
            :: else -> skip
            fi;
            m++
        :: !failed && m < N && m != i && HDR(i, m, k % 2) % REFUSED_BIT != HEADER(i, k) % REFUSED_BIT ->
            failed = true; aborted = true; break
        :: else -> break
        od;
#endif
        /* the reads: each other member's blocks, each after its wait */
        m = 0;
        do
        :: !failed && !refused && m < N ->
            if
            :: m != i ->
                j = 0;
                do
                :: j < B ->
#ifndef BUG_NOWAIT
                    if
                    :: BSIG(i, m, j) >= k -> skip
                    :: aborted -> failed = true; break
                    fi;
#endif
                    READ(BLK(i, m, k % NBUF, j));
                    j++
                :: else -> break
                od
            :: else -> skip
            fi;
            m++
        :: else -> break
        od
    :: else -> break
    od;
#ifdef MISMATCH
    assert(k <= 2 && (failed || aborted))
#else
    assert(k == C && !failed)
#endif
}

/* Member s's stores in flight become visible one at a time, in any order, at any time. */
#define FLUSHB(r, b, j) :: d_step { (r) < N && PBLK(r, s, b, j) != 0 -> BLK(r, s, b, j) = PBLK(r, s, b, j); PBLK(r, s, b, j) = 0 }
#define FLUSHH(r, b) :: d_step { (r) < N && PHDR(r, s, b) != 0 -> HDR(r, s, b) = PHDR(r, s, b); PHDR(r, s, b) = 0 }
proctype Memory(byte s) {
end:
    do
    FLUSHB(0, 0, 0) FLUSHB(0, 0, 1) FLUSHB(0, 1, 0) FLUSHB(0, 1, 1)
    FLUSHB(1, 0, 0) FLUSHB(1, 0, 1) FLUSHB(1, 1, 0) FLUSHB(1, 1, 1)
    FLUSHH(0, 0) FLUSHH(0, 1) FLUSHH(1, 0) FLUSHH(1, 1)
#if N > 2
    FLUSHB(2, 0, 0) FLUSHB(2, 0, 1) FLUSHB(2, 1, 0) FLUSHB(2, 1, 1)
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
