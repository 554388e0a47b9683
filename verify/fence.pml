/*
 * Models:
 *   symmsync/language/fence.py: publish, pending, wait, publish_and_wait, mark_abort
 *   symmsync/language/core.py: _publish (_release_slots, _advance_epoch), bounded_poll (KIND=MEMBERS),
 *     scan_members (BEHIND, BEHIND_SPLIT): the one publish, poll and member scan of every wait
 *   symmsync/core/fence.py: Fence.fence, Fence.arrive, Fence.wait (their kernel, _fence_kernel),
 *     Fence.refuse (_refuse_kernel) and Fence.refusals
 *
 * symmsync's epoch fence, as those functions implement it (the cell layout of symmsync/language/cells.py),
 * together with its user's payload protocol (tests/core/test_fence.py: stamps double-buffered by
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
 *   ABORT          one rank (any, or none) aborts at any point, even in the middle of its own
 *                  publish (PeerView.abort / Fence.abort / close(): mark_abort sets its flag in
 *                  every member's slot of every channel of the view, one release-OR at a time);
 *                  its host launches nothing more, what it already launched runs on, and after
 *                  the marking it may stop for good at any point (its process ends)
 *   REFUSE         any member may refuse its part of any fence (Fence.refuse): before its publish
 *                  it stores the epoch into its refusal word of that epoch's parity in every
 *                  member's cell (its own directly, the peers' through in-flight stores); after
 *                  each wait that returned 0 a member reads its own cell's words (Fence.refusals)
 *                  and must find exactly the members that refused that fence
 * Bug variants (each must yield a counterexample):
 *   BUG_EQ         wait compares slot == e instead of slot >= e
 *   BUG_EARLY      publish before the payload stores
 *   BUG_SINGLE     one payload buffer instead of two (no epoch parity)
 *   BUG_RELAXED    publish without release: earlier stores stay in flight
 *   BUG_SHARED     all channels share one cell
 *   BUG_OPEN       a timed-out wait goes on as if it had succeeded (fails open)
 *   BUG_FLAG       the abort flag counts as an arrival (a flag bit inside the compared value,
 *                  e.g. bit 62, with an unmasked slot >= e)
 *   BUG_UNMASKED   a flagged slot is an abort whatever its count (no mask): a member that
 *                  published the epoch and then closed fails a fence that had completed
 *   BUG_NOMARK     an abort that only stops the rank, with no flags: its peers wait forever
 *   BUG_ONEWORD    one refusal word per member instead of two (no epoch parity): a member one
 *                  fence ahead overwrites the mark a reader has not read yet
 *   BUG_LATEMARK   the refusal marks stored after the publish: a reader may miss them
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
#define CELL(v) (v)               /* CellLayout.cell(region, channel): one cell per channel */
#endif
#endif

#ifdef BUG_EQ
#define COUNTED(x, e) ((x) == (e))
#else
#define COUNTED(x, e) ((x) >= (e))  /* scan_members(BEHIND): (v & COUNT_MASK) < epoch counts as not arrived */
#endif
/* REACHED(c, g, j, e): one acquire load of slot j of cell c in rank g's memory (count and flag
 * are one int64 word, so one guard reads both at once) says member j arrived at epoch e;
 * GONE(...) says it aborted before e: wait() returns 2. */
#if defined(BUG_FLAG)
#define REACHED(c, g, j, e) (COUNTED(SLOT(c, g, j), e) || AFLAG(c, g, j))
#define GONE(c, g, j, e) 0
#elif defined(BUG_UNMASKED)
#define REACHED(c, g, j, e) (COUNTED(SLOT(c, g, j), e) && !AFLAG(c, g, j))
#define GONE(c, g, j, e) (AFLAG(c, g, j))
#else
#define REACHED(c, g, j, e) (COUNTED(SLOT(c, g, j), e))
#define GONE(c, g, j, e) (!COUNTED(SLOT(c, g, j), e) && AFLAG(c, g, j))
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
/* cell c in rank g's memory: the abort flag of slot j (the sign bit of the same int64 word) */
bit aflag[NCELL * NG * VS];
#define AFLAG(c, g, j) aflag[((c) * NG + (g)) * VS + (j)]
/* cell c in rank g's memory: the epoch word, g's own counter */
byte ep[NCELL * NG];
#define EPOCH(c, g) ep[(c) * NG + (g)]
/* the payload of view v in member p's memory: half b, the stamp member j wrote there (0: none) */
byte pay[NV * VS * 2 * VS];
#define PAY(v, p, b, j) pay[(((v) * VS + (p)) * 2 + (b)) * VS + (j)]
/* weak memory: member i's last store to PAY(v, p, b, i) that p cannot see yet (0: none) */
byte pend[NV * VS * VS * 2];
#define PEND(v, i, p, b) pend[(((v) * VS + (i)) * VS + (p)) * 2 + (b)]

#ifdef REFUSE
/* cell c in rank g's memory: refused[j][b], the last epoch of parity b that member j refused (0: none) */
byte refw[NCELL * NG * VS * 2];
#define REFW(c, g, j, b) refw[(((c) * NG + (g)) * VS + (j)) * 2 + (b)]
/* weak memory: member i's last refusal mark to member p's word b that p cannot see yet (0: none) */
byte rpend[NV * VS * VS * 2];
#define RPEND(v, i, p, b) rpend[(((v) * VS + (i)) * VS + (p)) * 2 + (b)]
/* ghost: member j of view v refused its part of fence k */
bit refd[NV * VS * (F + 1)];
#define REFD(v, j, k) refd[((v) * VS + (j)) * (F + 1) + (k)]
#ifdef BUG_ONEWORD
#define MB(k) 0
#else
#define MB(k) ((k) % 2)             /* the refusal word of fence k (epoch parity) */
#endif
/* Fence.refuse()'s marks (_refuse_kernel): epoch k into word MB(k) of this member, in every cell */
#define MARKS \
    d_step { \
        REFD(v, i, k) = 1; \
        for (q : 0 .. VS - 1) { \
            if :: q == i -> REFW(c, g, i, MB(k)) = k \
               :: else -> RPEND(v, i, q, MB(k)) = k fi \
        } \
        q = 0 \
    }
#define RPEND_TO(v, i, p, b) \
    if :: RPEND(v, i, p, b) != 0 -> REFW(CELL(v), G(v, p), i, b) = RPEND(v, i, p, b); RPEND(v, i, p, b) = 0 \
       :: else -> skip fi
#define RELEASE_MARKS(v, i) for (q : 0 .. VS - 1) { RPEND_TO(v, i, q, 0); RPEND_TO(v, i, q, 1) }
#else
#define RELEASE_MARKS(v, i) skip
#endif

/* ---- ghost state: what the specification talks about, never read by the protocol ---- */
/* how many of member j's publishes on view v have sent their lane to member p */
byte sent[NV * VS * VS];
#define SENT(v, j, p) sent[((v) * VS + (j)) * VS + (p)]
bit dead[NG];                 /* the rank stopped (CRASH; ABORT: its process ended) */
bit aborting[NG];             /* the rank's host aborted (ABORT): it launches no more fences */
bit gaveup[NV * VS];          /* the member's wait timed out; it never goes on */
#define STOPPED(v, j) (dead[G(v, j)] || gaveup[(v) * VS + (j)])

/* every other member's slot of cell c in rank g's memory has reached e (one poll of scan_members(BEHIND)) */
#if VS == 2
#define ALL_REACHED(c, g, i, e) REACHED(c, g, 1 - (i), e)
#define ANY_GONE(c, g, i, e) GONE(c, g, 1 - (i), e)
#define MISSING_STOPPED(v, c, g, i, e) (SLOT(c, g, 1 - (i)) < (e) && STOPPED(v, 1 - (i)))
#define ALL_SENT(v, i, k) (SENT(v, 1 - (i), i) >= (k))
/* an aborted wait is justified: a member whose flag it saw had not delivered its k-th publish */
#define ABORT_JUSTIFIED(v, c, g, i, k) (AFLAG(c, g, 1 - (i)) && SENT(v, 1 - (i), i) < (k))
#else
#define ALL_REACHED(c, g, i, e) (REACHED(c, g, ((i) + 1) % 3, e) && REACHED(c, g, ((i) + 2) % 3, e))
#define ANY_GONE(c, g, i, e) (GONE(c, g, ((i) + 1) % 3, e) || GONE(c, g, ((i) + 2) % 3, e))
#define MISSING_STOPPED(v, c, g, i, e) \
    ((SLOT(c, g, ((i) + 1) % 3) < (e) && STOPPED(v, ((i) + 1) % 3)) || \
     (SLOT(c, g, ((i) + 2) % 3) < (e) && STOPPED(v, ((i) + 2) % 3)))
#define ALL_SENT(v, i, k) (SENT(v, ((i) + 1) % 3, i) >= (k) && SENT(v, ((i) + 2) % 3, i) >= (k))
#define ABORT_JUSTIFIED(v, c, g, i, k) \
    ((AFLAG(c, g, ((i) + 1) % 3) && SENT(v, ((i) + 1) % 3, i) < (k)) || \
     (AFLAG(c, g, ((i) + 2) % 3) && SENT(v, ((i) + 2) % 3, i) < (k)))
#endif

/* publish(), one lane: red.release.sys.add(&mem[p].cell.slot[me], 1). The release first makes
 * every earlier store of this member visible (flushes its in-flight stores); relaxed does not. */
#ifdef BUG_RELAXED
#define RELEASE(v, i) skip
#else
#define RELEASE(v, i) \
    for (q : 0 .. VS - 1) { PEND_TO_PAY(v, i, q, 0); PEND_TO_PAY(v, i, q, 1) }; RELEASE_MARKS(v, i)
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
    byte k = 0;   /* the user's fence counter (tests/core/test_fence.py: the loop's e) */
    byte e = 0;   /* the epoch the wait targets */
    byte q = 0;
#if defined(CRASH) || defined(ABORT)
    {
#endif
    do
#ifdef ABORT
    :: k < F && aborting[g] -> goto stop   /* its host aborted: the next fence raises at once */
    :: k < F && !aborting[g] ->
#else
    :: k < F ->
#endif
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
#if defined(REFUSE) && !defined(BUG_LATEMARK)
        /* this member refuses its part of fence k, or does not */
        if :: skip :: MARKS fi;
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
#if defined(REFUSE) && defined(BUG_LATEMARK)
        if :: skip :: MARKS fi;
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
        /* wait(e): bounded_poll(KIND=MEMBERS) of scan_members(e) */
        if
        :: ALL_REACHED(c, g, i, e) -> skip
#ifdef ABORT
        :: atomic { ANY_GONE(c, g, i, e) ->
               /* wait() returned 2: the flag it saw belongs to a member whose k-th publish had not
                * reached this member (a member that published it and aborted later never fails it) */
               assert(ABORT_JUSTIFIED(v, c, g, i, k));
               gaveup[v * VS + i] = 1 };
           goto stop
#endif
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
#ifdef REFUSE
        /* Fence.refusals() after this wait: member q's word of fence k holds k exactly when q refused it */
        d_step {
            for (q : 0 .. VS - 1) { assert(REFD(v, q, k) == (refw[((c * NG + g) * VS + q) * 2 + MB(k)] == k)) }
            q = 0
        }
#endif
    :: else -> break
    od;
    /* finished all F fences */
    assert(k == F);
#ifndef BUG_SHARED
    assert(EPOCH(c, g) == F);
#endif
#if defined(CRASH) || defined(ABORT)
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
#ifdef REFUSE
    :: d_step { RPEND(v, i, p, 0) != 0 -> REFW(CELL(v), G(v, p), i, 0) = RPEND(v, i, p, 0); RPEND(v, i, p, 0) = 0 }
    :: d_step { RPEND(v, i, p, 1) != 0 -> REFW(CELL(v), G(v, p), i, 1) = RPEND(v, i, p, 1); RPEND(v, i, p, 1) = 0 }
#endif
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

#ifdef ABORT
#ifdef DISJOINT
#define IN_VIEW(v, r) ((r) / VS == (v))
#define INDEX(v, r) ((r) % VS)
#else
#define IN_VIEW(v, r) 1
#define INDEX(v, r) (r)
#endif
/* At most one rank aborts (or none does), at any moment: its host stops launching, then
 * mark_abort() sets its flag at every other member of every channel/view it belongs to, one
 * release-OR at a time in any order, while the kernels it already launched run on. Once every
 * flag is out, its process may end at any point (dead: its kernels stop where they are). */
#define MARK(v, p) \
    :: atomic { (v) < NV && (p) < VS && IN_VIEW(v, r) && (p) != INDEX(v, r) && \
                !AFLAG(CELL(v), G(v, p), INDEX(v, r)) -> AFLAG(CELL(v), G(v, p), INDEX(v, r)) = 1 }
proctype Aborter() {
    byte r;
    select (r : 0 .. NG);   /* r == NG: nobody aborts */
    if
    :: r < NG ->
        aborting[r] = 1;
#ifndef BUG_NOMARK
        do   /* one flag per step, in any order, until every one is out */
        MARK(0, 0) MARK(0, 1) MARK(0, 2) MARK(1, 0) MARK(1, 1) MARK(1, 2)
        :: else -> break
        od;
#endif
        if
        :: dead[r] = 1
        :: skip
        fi
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
#ifdef ABORT
        run Aborter();
#endif
    }
}
