/*
 * Models:
 *   symmsync/moe/protocol.py: parity, post (the header with the refusal, then the signals), sent
 *     (a dispatch's second signal), check (the wait for every member's signal count, 2n + 1 or
 *     2n + 2, then the header check), finish (the step counted); the header is the consumer kit's
 *     call header (symmsync/language/calls.py: post_call pushes it into every member's headers of
 *     parity n % 2, check_call compares them)
 *   symmsync/moe/kernels.py: dispatch_send (phase A: the counts, the header, the first signal;
 *     phase B: the counts wait and check, the rows read from nowhere but stored once, into their
 *     packed places, then the second signal), dispatch_recv (the wait for every member's second
 *     signal, the check, the counts read); combine_send (the rows, then the header and both
 *     signals), combine_reduce (the wait, the check, the read): one step counter and one signal
 *     slot for both kinds of step (2 per step); one program per launch (the arrival counter that
 *     makes a launch's last program signal is the fence's `arrive`, whose argument
 *     language/core.py gives)
 *   (on symmsync/language/signals.py: signal, ADD with release; wait_signal GE, acquire, as
 *   verify/signals.pml models them)
 *
 * The dispatcher's buffer reuse and its step check: every member runs S steps back to back, with
 * no host barrier; step k of member i (k = 1 .. S) is a dispatch or a combine (KIND(i, k)).
 * A dispatch: (A) store its counts into every member's counts from i of parity k % 2, and its
 * header (k, kind) into every member's headers from i of parity k % 2 (plain stores: they land
 * at any time, or at i's next release), signal every member (a release add); (B) wait until every
 * other member's signal count reached 2k - 1 and compare every member's header with its own
 * (one that differs fails the step: a mismatch; every member, having every header, fails the same
 * step, and the host then fails the dispatcher, aborting the view: modelled as the abort, which
 * also ends the waits of a member that had not checked yet); read the counts of the members
 * before it (its rows' offsets), store its rows into every member's rows buffer d % 2 (d: the
 * dispatches this member made before: the host's count), signal every member; (R) wait until every
 * member's count reached 2k, read every member's counts and its rows. A combine: store its rows
 * into every member's combine rows of parity k % 2, its header, signal every member twice; wait
 * until every member's count reached 2k, check, read. Each read asserts that what it reads is
 * step k's: neither stale (not landed yet, or another step's) nor overwritten (a faster member's
 * later step wrote it while this one still reads). The rows a dispatch receives are read before
 * this member's next step: their users run on its stream before its next call.
 * verify/check.py lists the configurations.
 *
 * Configuration:
 *   N=n            members (2 or 3)
 *   S=n            steps each member makes (alternating: dispatch, combine, dispatch, ...)
 *   ONEKIND        every step a dispatch (dispatches with no combine between them)
 *   MISMATCH       member 1 makes the other kind of step at step 2: every member must stop at
 *                  step 2 at the latest, failed or aborted, having read nothing of it
 *   REFUSE         member 1 refuses its step 2 (a bad argument): it sends zero counts and no rows,
 *                  its header says so; every member reads nothing of step 2 and every member
 *                  makes all S steps, the later ones read right
 * Bug variants (each must yield a counterexample):
 *   BUG_NOPARITY   (with ONEKIND) one copy of the counts and one rows buffer, no parity: a fast
 *                  member's next counts overwrite counts a slow member still reads
 *   BUG_NOWAIT     no counted waits: the header check reads a header not landed yet, and a step
 *                  every member made alike fails (or counts not landed are read)
 *   BUG_EARLY      the signals before the stores (no release order): rows read before they land
 *   BUG_NOHEADER   (with MISMATCH) no header check: a member reads a step the other never made
 *   BUG_NOREFUSE   (with REFUSE) the check blind to a refusal: a member reads rows never sent
 *   BUG_NOCOUNTWAIT  a dispatch's rows stored before its counts wait: the offsets come from counts
 *                  not landed yet
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

/* rows[r][s][kind][b]: the step that last wrote member r's rows of that kind from sender s in
 * copy b (a dispatch's: the sender's count of dispatches modulo NBUF; a combine's: parity) (0:
 * none); prows: sender s's store not visible yet */
byte rows[N * N * 4];
byte prows[N * N * 4];
#define RI(r, s, c, b) ((((r) * N + (s)) * 2 + (c)) * 2 + (b))
#define ROWS(r, s, c, b) rows[RI(r, s, c, b)]
#define PROWS(r, s, c, b) prows[RI(r, s, c, b)]
/* cnt[r][s][b]: the dispatch step whose counts sender s last stored in member r's counts of
 * parity b (0: none); pcnt: not visible yet */
byte cnt[N * N * 2];
byte pcnt[N * N * 2];
#define CI(r, s, b) (((r) * N + (s)) * 2 + (b))
#define CNT(r, s, b) cnt[CI(r, s, b)]
#define PCNT(r, s, b) pcnt[CI(r, s, b)]
/* hdr[r][s][b]: the header sender s last stored in member r's headers of parity b, 2 k + kind + 1
 * (0: none); phdr: not visible yet */
byte hdr[N * N * 2];
byte phdr[N * N * 2];
#define HI(r, s, b) (((r) * N + (s)) * 2 + (b))
#define HDR(r, s, b) hdr[HI(r, s, b)]
#define PHDR(r, s, b) phdr[HI(r, s, b)]
/* sig[r][s]: what s signalled r on the step slot (ADD 1, twice per step) */
byte sig[N * N];
#define SIG(r, s) sig[(r) * N + (s)]
/* a member failed its step and aborted the view: every member's waits end */
bool aborted = false;

#define READ(v) assert((v) >= k); assert((v) <= k)
#define LANDR(r, c, b) if :: PROWS(r, i, c, b) != 0 -> ROWS(r, i, c, b) = PROWS(r, i, c, b); PROWS(r, i, c, b) = 0 :: else -> skip fi
#define LANDC(r, b) if :: PCNT(r, i, b) != 0 -> CNT(r, i, b) = PCNT(r, i, b); PCNT(r, i, b) = 0 :: else -> skip fi
#define LANDH(r, b) if :: PHDR(r, i, b) != 0 -> HDR(r, i, b) = PHDR(r, i, b); PHDR(r, i, b) = 0 :: else -> skip fi
/* the release: every earlier store of member i lands before the add */
#define RELEASE d_step { for (q : 0 .. N - 1) { LANDR(q, 0, 0); LANDR(q, 0, 1); LANDR(q, 1, 0); LANDR(q, 1, 1); LANDC(q, 0); LANDC(q, 1); LANDH(q, 0); LANDH(q, 1) }; q = 0 }
#ifndef BUG_EARLY
#define SIGNAL_ALL m = 0; do :: m < N -> RELEASE; SIG(m, i)++; m++ :: else -> break od
#else
#define SIGNAL_ALL m = 0; do :: m < N -> SIG(m, i)++; RELEASE; m++ :: else -> break od
#endif
/* the counted wait: every member's count (SELF: its own too) reached T, or an abort ends it */
#ifndef BUG_NOWAIT
#define WAIT_ALL(T, SELF) m = 0; do :: m < N && (SELF || m != i) -> if :: SIG(i, m) >= (T) -> m++ :: aborted -> failed = true; break fi :: m < N && !(SELF || m != i) -> m++ :: else -> break od
#else
#define WAIT_ALL(T, SELF) skip
#endif
/* the header check: a header that is not this step's fails it (and aborts the view) */
#ifndef BUG_NOREFUSE
#define SEE_REFUSAL if :: HDR(i, m, k % 2) >= REFUSED_BIT -> refused = true :: else -> skip fi
#else
#define SEE_REFUSAL skip
#endif
#ifndef BUG_NOHEADER
#define CHECK m = 0; do \
    :: !failed && m < N && HDR(i, m, k % 2) % REFUSED_BIT == 2 * k + c + 1 -> SEE_REFUSAL; m++ \
    :: !failed && m < N && HDR(i, m, k % 2) % REFUSED_BIT != 2 * k + c + 1 -> failed = true; aborted = true; break \
    :: else -> break od
#else
#define CHECK skip
#endif

proctype Member(byte i) {
    byte k = 0;
    byte d = 0;  /* dispatches made: the host's count, which picks a dispatch's rows buffer */
    byte b = 0;
    byte q = 0;
    byte m = 0;
    byte c = 0;
    bool failed = false;
    bool refused = false;
    do
    :: k < S && !failed && !aborted ->
        k++;
        c = KIND(i, k);
        refused = false;
        if
        :: c == 0 ->
            b = d % NBUF;
            d++;
            /* phase A: the counts and the header, then the first signal */
            d_step { for (q : 0 .. N - 1) { PCNT(q, i, k % NBUF) = k; PHDR(q, i, k % 2) = 2 * k + c + 1 + (REFUSES(i, k) -> REFUSED_BIT : 0) }; q = 0 };
            SIGNAL_ALL;
#ifdef BUG_NOCOUNTWAIT
            /* the rows before the counts wait: the offsets from the earlier members' counts as found */
            m = 0;
            do :: m < i -> READ(CNT(i, m, k % NBUF)); m++ :: else -> break od;
            if
            :: !REFUSES(i, k) -> skip; d_step { for (q : 0 .. N - 1) { PROWS(q, i, 0, b) = k }; q = 0 }
            :: else -> skip
            fi;
#endif
            /* phase B: every other member's counts and header, the check */
            WAIT_ALL(2 * k - 1, false);
            CHECK;
#ifndef BUG_NOCOUNTWAIT
            if
            :: !failed && !refused && !REFUSES(i, k) ->  /* a refusing member has no rows to send */
                /* the offsets: the counts of the members before it */
                m = 0;
                do :: m < i -> READ(CNT(i, m, k % NBUF)); m++ :: else -> break od;
                skip;  /* no jump into the d_step */
                d_step { for (q : 0 .. N - 1) { PROWS(q, i, 0, b) = k }; q = 0 }
            :: else -> skip
            fi;
#endif
            if
            :: failed -> break
            :: else -> skip
            fi;
            SIGNAL_ALL;
            /* the receive: every member's rows, the check again, the counts and (by the users) the rows */
            WAIT_ALL(2 * k, true);
            CHECK;
            m = 0;
            do :: !failed && m < N -> READ(CNT(i, m, k % NBUF)); m++ :: else -> break od;
            m = 0;
            do :: !failed && !refused && m < N -> READ(ROWS(i, m, 0, b)); m++ :: else -> break od
        :: else ->
            /* a combine: the rows (none when refused), the header, both signals */
            if
            :: !REFUSES(i, k) -> d_step { for (q : 0 .. N - 1) { PROWS(q, i, 1, k % 2) = k }; q = 0 }
            :: else -> skip
            fi;
            d_step { for (q : 0 .. N - 1) { PHDR(q, i, k % 2) = 2 * k + c + 1 + (REFUSES(i, k) -> REFUSED_BIT : 0) }; q = 0 };
            SIGNAL_ALL;
            SIGNAL_ALL;
            WAIT_ALL(2 * k, true);
            CHECK;
            m = 0;
            do :: !failed && !refused && m < N -> READ(ROWS(i, m, 1, k % 2)); m++ :: else -> break od
        fi
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
#define FLUSHC(r, b) :: d_step { (r) < N && PCNT(r, s, b) != 0 -> CNT(r, s, b) = PCNT(r, s, b); PCNT(r, s, b) = 0 }
#define FLUSHH(r, b) :: d_step { (r) < N && PHDR(r, s, b) != 0 -> HDR(r, s, b) = PHDR(r, s, b); PHDR(r, s, b) = 0 }
proctype Memory(byte s) {
end:
    do
    FLUSHR(0, 0, 0) FLUSHR(0, 0, 1) FLUSHR(0, 1, 0) FLUSHR(0, 1, 1)
    FLUSHR(1, 0, 0) FLUSHR(1, 0, 1) FLUSHR(1, 1, 0) FLUSHR(1, 1, 1)
    FLUSHC(0, 0) FLUSHC(0, 1) FLUSHC(1, 0) FLUSHC(1, 1)
    FLUSHH(0, 0) FLUSHH(0, 1) FLUSHH(1, 0) FLUSHH(1, 1)
#if N > 2
    FLUSHR(2, 0, 0) FLUSHR(2, 0, 1) FLUSHR(2, 1, 0) FLUSHR(2, 1, 1)
    FLUSHC(2, 0) FLUSHC(2, 1)
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
