/*
 * Models:
 *   symmsync/collectives/kernels.py: collective_kernel (its slots, fences and reads)
 *   symmsync/collectives/protocol.py: next_epoch, arrive, wait
 *   symmsync/language/calls.py: call_number, post_call, check_call, end_call (the call header)
 *     (on symmsync/language/core.py: arrive, _publish, bounded_poll, and
 *     symmsync/language/fence.py: wait_or_trap, as verify/fence.pml models them)
 *
 * The collectives' slot protocol, as those functions implement it (the pseudocode of
 * protocol.py's module docstring). Every member of a view makes the same calls, back to back,
 * with no host barrier between them: each call copies its input into its own slot of parity e % 2
 * (or the caller filled its symmetric input, one slot), stores its call header into every
 * member's header memory at the parity of the call's number k % 2 (the kit's push), publishes e,
 * waits for e, checks every member's header in its own memory and reads every member's slot. A two-shot
 * call then writes its reduced chunk (one slot), publishes e + 1, waits for e + 1 and reads the
 * others' reduced chunks; a one-shot call on the symmetric input publishes e + 1 and waits for it
 * before the kernel ends, so that the caller may refill the input at once. Every read asserts that
 * the value is the one written for this call: neither stale (not yet landed) nor overwritten by a
 * faster member's next call. verify/check.py lists the configurations; verify/README.md maps each
 * construct to the code.
 *
 * Configuration:
 *   N=n            members of the view (2 or 3)
 *   C=n            calls each member makes, back to back
 *   KIND=k         what every call is: ONE (one phase, copied-in input: the one-shot all-reduce,
 *                  the all-gather, the reduce-scatter), TWO (two-shot all-reduce, copied-in input),
 *                  SYM (one phase, symmetric input), SYM_TWO (two-shot, symmetric input), or MIX
 *                  (each call any of the four, the same on every member: the headers agree)
 *   REFUSE         the last member refuses call 2 (its input failed its checks): it copies nothing,
 *                  its headers say refused, it publishes once; every member sees the refusal after
 *                  its wait, reads nothing of that call and skips its second phase, so that every
 *                  member's epochs stay in step and the later calls are read right
 * Bug variants (each must yield a counterexample):
 *   BUG_NBUF1      one input slot, no epoch parity (the kernel's NBUF=1): a fast member's next
 *                  copy-in overwrites a slot a slow member still reads
 *   BUG_NOFENCE2   no second fence (no publish e + 1, no wait e + 1): a two-shot call reads
 *                  reduced chunks not yet written; a symmetric call returns while the others still
 *                  read its input, and the caller's refill overwrites it
 *   BUG_NOREFUSE   (with REFUSE) the kernel blind to a refused header: the members read the refusing
 *                  member's input, which it never copied
 *   BUG_HDR1       one header per sender, no parity (the call's number modulo 2 dropped): a fast
 *                  member's next header lands where a slow member still checks this call's
 */

#ifndef N
#define N 2
#endif
#ifndef C
#define C 3
#endif

#define MIX 0
#define ONE 1
#define TWO 2
#define SYM 3
#define SYM_TWO 4
#ifndef KIND
#define KIND MIX
#endif
#define SYMMETRIC(t) ((t) == SYM || (t) == SYM_TWO)
#define TWO_SHOT(t) ((t) == TWO || (t) == SYM_TWO)
#define PHASES(t) (1 + ((t) != ONE))      /* collective_kernel's PHASES: 2 if TWO_SHOT or SYMMETRIC */

#ifdef REFUSE
#define REFUSES(i, k) ((i) == N - 1 && (k) == 2)
#else
#define REFUSES(i, k) 0
#endif
#define REFUSED_MARK 100  /* a refused header: the call's stamp plus this (the code: numel < 0) */

#ifdef BUG_NBUF1
#define NBUF 1
#else
#define NBUF 2
#endif

/* ---- what every member calls: kind[k] is call k's (1..C), chosen once for all members ---- */
byte kind[C + 1];

/* ---- the fence cell (as verify/fence.pml): slot j in member g's memory counts j's publishes ---- */
byte slot[N * N];
#define SLOT(g, j) slot[(g) * N + (j)]
byte ep[N];                       /* each member's epoch word */

/* ---- each member's workspace, as every other member sees it: the stamp k of the call that wrote
 * it (0: never written) ---- */
byte inp[N * 2];                  /* input[b]: copied-in input of parity b (layout.INPUT) */
#define INP(p, b) inp[(p) * 2 + (b)]
#ifdef BUG_HDR1
#define HBUF 1
#else
#define HBUF 2
#endif
byte hdr[N * N * 2];              /* HDR(r, s, b): member s's header of parity b in member r's header
                                   * memory (language/calls.py); its number word tells calls apart */
#define HDR(r, s, b) hdr[((r) * N + (s)) * 2 + (b)]
byte sym[N];                      /* the symmetric input (layout SYMMETRIC), filled by the caller */
byte red[N];                      /* the two-shot's reduced chunk (layout REDUCED) */
/* weak memory: member p's last store to each of them that the others cannot see yet (0: none) */
byte pinp[N * 2];
#define PINP(p, b) pinp[(p) * 2 + (b)]
byte phdr[N * N * 2];             /* member s's header store into member r's memory, not landed */
#define PHDR(r, s, b) phdr[((r) * N + (s)) * 2 + (b)]
byte psym[N];
byte pred[N];

/* a value read for call k: landed (not an earlier call's: stale) and not overwritten (not a later
 * call's: a faster member's next call wrote it while this one still reads) */
#define READ(v) assert((v) >= k); assert((v) <= k)

#define LAND(pv, v) if :: (pv) != 0 -> v = pv; pv = 0 :: else -> skip fi
/* publish's release: every earlier store of member i (copy-in, headers into every member's memory,
 * the caller's fill, reduced chunk) becomes visible before its reduction does (cumulativity) */
#define HDRS(r, i) LAND(PHDR(r, i, 0), HDR(r, i, 0)); LAND(PHDR(r, i, 1), HDR(r, i, 1))
#if N == 2
#define RELEASE_HDRS(i) HDRS(0, i); HDRS(1, i)
#else
#define RELEASE_HDRS(i) HDRS(0, i); HDRS(1, i); HDRS(2, i)
#endif
#define RELEASE(i) \
    LAND(PINP(i, 0), INP(i, 0)); LAND(PINP(i, 1), INP(i, 1)); RELEASE_HDRS(i); \
    LAND(psym[i], sym[i]); LAND(pred[i], red[i])
#define LANE(p) d_step { RELEASE(i); SLOT(p, i)++ }

/* publish(): one release reduction per other member (landing in any order), then ++epoch */
#if N == 2
#define PUBLISH LANE(1 - i); ep[i]++
#define ALL_REACHED(e) (SLOT(i, 1 - i) >= (e))
#else
#define PUBLISH \
    if \
    :: LANE((i + 1) % 3); LANE((i + 2) % 3) \
    :: LANE((i + 2) % 3); LANE((i + 1) % 3) \
    fi; \
    ep[i]++
#define ALL_REACHED(e) (SLOT(i, (i + 1) % 3) >= (e) && SLOT(i, (i + 2) % 3) >= (e))
#endif

/* One member: C calls back to back, each one launch of collective_kernel with one program. */
proctype Member(byte i) {
    byte k = 0;   /* the call (its stamp) */
    byte t = 0;   /* its kind */
    byte e = 0;   /* its first epoch: next_epoch() */
    byte q = 0;
    bool refused = false;
    do
    :: k < C ->
        d_step {
            k++;
            t = kind[k];
            e = ep[i] + 1;
            /* the caller fills its symmetric input (before the launch, in stream order), or the
             * kernel copies the input into input[e % NBUF]; program 0 stores its header of call k
             * into every member's header memory at parity k % HBUF (post_call) */
            if
            :: REFUSES(i, k) ->                     /* nothing copied; the headers say so */
                for (q : 0 .. N - 1) { PHDR(q, i, k % HBUF) = k + REFUSED_MARK }
            :: else ->
                if
                :: SYMMETRIC(t) -> psym[i] = k
                :: else -> PINP(i, e % NBUF) = k
                fi;
                for (q : 0 .. N - 1) { PHDR(q, i, k % HBUF) = k }
            fi;
            q = 0
        }
        PUBLISH;                            /* arrive(): the (last) program publishes e */
        (ALL_REACHED(e));                   /* wait(e) */
        /* check_call (every other member's header, in this member's own memory), then the reads of
         * every other member's slot of this call */
        d_step {
            assert(ep[i] == e);             /* the epoch publish returned is next_epoch's */
            refused = REFUSES(i, k);
            for (q : 0 .. N - 1) {
                if
                :: q != i ->
                    READ(HDR(i, q, k % HBUF) % REFUSED_MARK);
#ifndef BUG_NOREFUSE
                    if :: HDR(i, q, k % HBUF) >= REFUSED_MARK -> refused = true :: else -> skip fi
#endif
                :: else -> skip
                fi
            }
            for (q : 0 .. N - 1) {
                if
                :: q != i && !refused ->
                    if
                    :: SYMMETRIC(t) -> READ(sym[q])
                    :: else -> READ(INP(q, e % NBUF))
                    fi
                :: else -> skip
                fi
            }
            q = 0
        }
#ifndef BUG_NOFENCE2
        if
        :: PHASES(t) == 2 && !refused ->
            if
            :: TWO_SHOT(t) -> pred[i] = k   /* this member's chunk, reduced */
            :: else -> skip
            fi;
            PUBLISH;                        /* the second arrive(): publish e + 1 */
            (ALL_REACHED(e + 1))            /* wait(e + 1) */
        :: else -> skip
        fi;
#else
        if
        :: TWO_SHOT(t) && !refused -> pred[i] = k
        :: else -> skip
        fi;
#endif
        /* two-shot: gather the other members' reduced chunks */
        d_step {
            if
            :: TWO_SHOT(t) && !refused ->
                for (q : 0 .. N - 1) {
                    if :: q != i -> READ(red[q]) :: else -> skip fi
                }
                q = 0
            :: else -> skip
            fi
        }
    :: else -> break
    od;
    assert(k == C)
}

/* Member p's stores in flight become visible one at a time, in any order, at any time. */
/* one of member p's header stores, into member r's memory, parity b */
#define LAND_HDR(r, b) :: d_step { PHDR(r, p, b) != 0 -> HDR(r, p, b) = PHDR(r, p, b); PHDR(r, p, b) = 0 }
proctype Memory(byte p) {
end:
    do
    :: d_step { PINP(p, 0) != 0 -> INP(p, 0) = PINP(p, 0); PINP(p, 0) = 0 }
    :: d_step { PINP(p, 1) != 0 -> INP(p, 1) = PINP(p, 1); PINP(p, 1) = 0 }
    LAND_HDR(0, 0)
    LAND_HDR(0, 1)
    LAND_HDR(1, 0)
    LAND_HDR(1, 1)
#if N == 3
    LAND_HDR(2, 0)
    LAND_HDR(2, 1)
#endif
    :: d_step { psym[p] != 0 -> sym[p] = psym[p]; psym[p] = 0 }
    :: d_step { pred[p] != 0 -> red[p] = pred[p]; pred[p] = 0 }
    od
}

init {
    byte k, p;
    atomic {
        for (k : 1 .. C) {
#if KIND == MIX
            select (p : ONE .. SYM_TWO);
            kind[k] = p;
#else
            kind[k] = KIND;
#endif
        }
        for (p : 0 .. N - 1) {
            run Member(p);
            run Memory(p)
        }
    }
}
