/* The element-wise three-way merge step in one pass per tensor (merges/_threeway.py).
 *
 * For every element: changed on one side only -> that side's bits; equal on both ->
 * taken; changed differently on both -> the strategy's value, computed in float32
 * (float64 for F64) exactly as the NumPy definition orders its operations, and rounded
 * once to the dtype. NumPy needs a dozen passes and as many tensor-sized temporaries for
 * that (widen, compare, select, combine, narrow); here each element is read once and
 * written once, and the loop runs without the GIL so two tensors merge on two cores.
 *
 * The NumPy code in merges/ stays the definition (GIT_THETA_KERNELS=numpy runs it) and
 * tests/test_merge_kernel.py checks the two agree bit for bit on every dtype. Built
 * with -ffp-contract=off: a fused multiply-add would round differently from NumPy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Element kinds (merges/_threeway.py's _KINDS). */
enum { K_F32 = 1, K_F16 = 2, K_BF16 = 3, K_F64 = 4 };
/* Strategies (merges/_threeway.py's _STRATEGIES). */
enum { S_OURS = 0, S_THEIRS = 1, S_BASE = 2, S_AVERAGE = 3, S_TASK = 4, S_TIES = 5 };

/* The NumPy definition checks finiteness block by block and reports the first bad
 * block's count; so does this (the same BLOCK as _threeway.py). */
#define BLOCK ((Py_ssize_t)1 << 15)

typedef struct {
    double wo, wt;     /* weights, already rounded to the working type by the caller */
    double divisor;    /* task arithmetic: divide the mix by this when has_divisor */
    double lam;        /* scale of the mix, applied when != 1 */
    int has_divisor;
    int normalize;     /* TIES: divide by the agreeing sides' summed weights */
    int cut_o, cut_t;  /* TIES: trim that side's task vector */
    double mag_o, mag_t;
    Py_ssize_t last_o, last_t;
} params_t;

/* --- bits <-> working floats, round to nearest even, as NumPy and _floats.py ------- */

static inline float f32_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float widen_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t normal = sign | ((exp + 112) << 23) | (man << 13);
    uint32_t top = sign | 0x7f800000u | (man << 13);               /* inf, NaN */
    uint32_t sub = bits_of((float)man * 5.9604644775390625e-8f) | sign; /* man * 2**-24 */
    return f32_of(exp == 0 ? sub : (exp == 31 ? top : normal));
}

/* float32 -> F16, round to nearest even (NumPy's astype). */
static inline uint16_t narrow_f16(float f) {
    uint32_t u = bits_of(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    uint32_t payload = (a >> 13) & 0x3ffu;  /* a NaN keeps the top of its payload */
    uint32_t nan = sign | 0x7c00u | (payload | (payload == 0));
    uint32_t inf = sign | 0x7c00u;           /* inf, or past 65520 */
    /* A half subnormal counts units of 2**-24: the significand shifted right by
     * 126 - exponent (at least 14; 25 and more leave nothing), rounded to even. */
    uint32_t e = a >> 23;
    uint32_t sig = (a & 0x7fffffu) | (e ? 0x800000u : 0);
    uint32_t shift = e >= 101 && e < 113 ? 126 - e : 25; /* 25 also where unused */
    uint32_t units = sig >> shift, rest = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
    units += (rest > half) | ((rest == half) & units);
    uint32_t sub = sign | units;             /* 1024 is the smallest normal, as it should */
    /* Normal: rebias the exponent 127 -> 15 and round the 13 dropped bits to even; a
     * carry moves into the exponent, and past the largest half gives inf. */
    uint32_t rebased = a - (112u << 23);
    uint32_t normal = sign | ((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13);
    uint32_t h = a > 0x7f800000u ? nan : (a >= 0x47800000u ? inf : (a < 0x38800000u ? sub : normal));
    return (uint16_t)h;
}

static inline float widen_bf16(uint16_t h) { return f32_of((uint32_t)h << 16); }

static inline uint16_t narrow_bf16(float f) {
    uint32_t u = bits_of(f);
    uint32_t nan = (u >> 16) | 0x40u; /* quiet, sign and payload top kept */
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline int finite_f32(uint32_t u) { return (u & 0x7f800000u) != 0x7f800000u; }
static inline int finite_f16(uint16_t u) { return (u & 0x7c00u) != 0x7c00u; }
static inline int finite_bf16(uint16_t u) { return (u & 0x7f80u) != 0x7f80u; }
static inline int finite_f64(uint64_t u) {
    return (u & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

static inline float widen_f32(uint32_t u) { return f32_of(u); }
static inline uint32_t narrow_f32(float f) { return bits_of(f); }
static inline double widen_f64(uint64_t u) {
    double d;
    memcpy(&d, &u, 8);
    return d;
}
static inline uint64_t narrow_f64(double d) {
    uint64_t u;
    memcpy(&u, &d, 8);
    return u;
}

/* --- the strategies, in the NumPy definition's order of operations --------------- */

/* Where two operands may both be NaN, which NaN comes out matters to bit-exactness:
 * x86 returns the first operand's (quieted), and NumPy's loops put the definition's
 * left operand first; a C compiler may swap the operands of a + b. add_W keeps the
 * order. Every other operation here has at most one NaN operand (weights, masks and
 * divisors are finite). */
#define STRATEGIES(W)                                                                   \
    /* The params in the working type; an operation the definition skips is one that   \
     * changes nothing here: a division by 1, a scale of 1, a cut below every           \
     * magnitude (x / 1, x * 1 and NaN * 0 give x's bits back for the quiet values      \
     * these are applied to). */                                                        \
    typedef struct {                                                                    \
        W wo, wt, divisor, lam, mag_o, mag_t;                                           \
        int normalize;                                                                  \
        Py_ssize_t last_o, last_t;                                                      \
    } W##_params;                                                                       \
    static W##_params W##_of(const params_t *p) {                                       \
        W##_params q;                                                                   \
        q.wo = (W)p->wo, q.wt = (W)p->wt;                                               \
        q.divisor = p->has_divisor ? (W)p->divisor : (W)1;                              \
        q.lam = p->lam != 1.0 ? (W)p->lam : (W)1;                                       \
        q.mag_o = p->cut_o ? (W)p->mag_o : (W)-1, q.last_o = p->cut_o ? p->last_o : -1; \
        q.mag_t = p->cut_t ? (W)p->mag_t : (W)-1, q.last_t = p->cut_t ? p->last_t : -1; \
        q.normalize = p->normalize;                                                     \
        return q;                                                                       \
    }                                                                                   \
    static inline W add_##W(W a, W b) { return a != a ? a + a : a + b; }                \
    static inline W average_##W(W o, W t, const W##_params *q) {                        \
        return add_##W(o * q->wo, t * q->wt);                                           \
    }                                                                                   \
    /* linear.finish: divide, scale, add to the base. */                                \
    static inline W finish_##W(W b, W mixed, W divisor, const W##_params *q) {          \
        return add_##W(b, mixed / divisor * q->lam);                                    \
    }                                                                                   \
    static inline W task_##W(W b, W o, W t, const W##_params *q) {                      \
        W mixed = add_##W((o - b) * q->wo, (t - b) * q->wt);                            \
        return finish_##W(b, mixed, q->divisor, q);                                     \
    }                                                                                   \
    /* ties.Cut.keep: the magnitude above the cut, or equal to it at an index up to     \
     * `last` (`j` and `last` relative to the block); multiplied by 1 or 0 as NumPy     \
     * multiplies by the bool mask (0 * inf is NaN). */                                 \
    static inline W trim_##W(W d, W mag, int last, int j) {                             \
        W m = d < 0 ? -d : d; /* -0.0 -> -0.0, which compares as 0 */                   \
        int keep = (m > mag) | ((m == mag) & (j <= last));                              \
        return d * (W)keep;                                                             \
    }                                                                                   \
    /* ties.Ties.combine, then ties.elect. */                                           \
    static inline W ties_##W(W b, W o, W t, int j, int last_o, int last_t,              \
                             const W##_params *q) {                                     \
        W dob = trim_##W(o - b, q->mag_o, last_o, j) * q->wo;                           \
        W dtb = trim_##W(t - b, q->mag_t, last_t, j) * q->wt;                           \
        int positive = dob + dtb >= 0;                                                  \
        int agree_o = ((dob > 0) & positive) | ((dob < 0) & !positive);                 \
        int agree_t = ((dtb > 0) & positive) | ((dtb < 0) & !positive);                 \
        dob = dob * (W)agree_o;                                                         \
        dtb = dtb * (W)agree_t;                                                         \
        W mixed = add_##W(dob, dtb);                                                    \
        W divisor = (W)agree_o * q->wo + (W)agree_t * q->wt;                            \
        divisor += (W)(divisor == 0); /* 0 (or -0) -> 1, as ties.elect */               \
        return finish_##W(b, mixed, q->normalize ? divisor : (W)1, q);                  \
    }

STRATEGIES(float)
STRATEGIES(double)

/* --- the pass over a tensor, one per element kind --------------------------------- */

typedef struct {
    const unsigned char *b, *o, *t;  /* b is NULL for a tensor added on both sides */
    unsigned char *out;
    Py_ssize_t n;                    /* elements */
    int64_t counts[5];               /* unchanged, ours only, theirs only, same, merged */
    Py_ssize_t bad;                  /* non-finite results from finite inputs (first block) */
} pass_t;

/* Branch-free: the strategy's value is computed for every element and selected where
 * both sides changed it differently (a full fine-tune changes nearly all; the signs a
 * TIES election compares are random, and mispredicted branches cost more than the
 * arithmetic). The choice of strategy and of a base is made once, outside the loop. */
#define PASS(NAME, U, W, WIDEN, NARROW, FINITE)                                         \
    static inline __attribute__((always_inline)) void NAME##_with(                      \
        pass_t *r, const int s, const int has_base, const int in_t, const params_t *p) { \
        const W##_params q = W##_of(p);                                                 \
        const unsigned char *restrict pb = r->b, *restrict po = r->o, *restrict pt = r->t; \
        unsigned char *restrict pout = r->out;                                          \
        const Py_ssize_t n = r->n;                                                      \
        for (Py_ssize_t start = 0; start < n; start += BLOCK) {                         \
            const int len = (int)(start + BLOCK < n ? BLOCK : n - start);               \
            /* Block-relative, in int: the loop's lanes stay 32 bits wide. */           \
            const int last_o = (int)(q.last_o < start ? -1 : (q.last_o - start < BLOCK ? q.last_o - start : BLOCK)); \
            const int last_t = (int)(q.last_t < start ? -1 : (q.last_t - start < BLOCK ? q.last_t - start : BLOCK)); \
            const unsigned char *bb = pb + start * sizeof(U), *ob = po + start * sizeof(U); \
            unsigned char *out = pout + start * sizeof(U);                              \
            /* In place over theirs (in_t): its units are read through `out` itself,   \
             * each before the unit is written, so the restrict pointers stay apart. */ \
            const unsigned char *tb = in_t ? out : pt + start * sizeof(U);              \
            int c0 = 0, c1 = 0, c2 = 0, c3 = 0, c4 = 0, bad = 0;                        \
            for (int j = 0; j < len; j++) {                                             \
                U o, t, b, v;                                                           \
                memcpy(&o, ob + (size_t)j * sizeof(U), sizeof(U));                      \
                memcpy(&t, tb + (size_t)j * sizeof(U), sizeof(U));                      \
                if (has_base) memcpy(&b, bb + (size_t)j * sizeof(U), sizeof(U));        \
                else b = o;                                                             \
                W wb = WIDEN(b), wo = WIDEN(o), wt = WIDEN(t), m;                       \
                if (s == S_AVERAGE) m = average_##W(wo, wt, &q);                        \
                else if (s == S_TASK) m = task_##W(wb, wo, wt, &q);                     \
                else m = ties_##W(wb, wo, wt, j, last_o, last_t, &q);                   \
                U mv = NARROW(m);                                                       \
                int differ = o != t, conflict;                                          \
                if (has_base) {                                                         \
                    int oc = o != b, tc = t != b;                                       \
                    conflict = oc & tc & differ;                                        \
                    v = conflict ? mv : (tc ? t : o);                                   \
                    c0 += !(oc | tc);                                                   \
                    c1 += oc & !tc;                                                     \
                    c2 += tc & !oc;                                                     \
                    c3 += oc & tc & !differ;                                            \
                    bad += conflict & !FINITE(mv) & FINITE(o) & FINITE(t) & FINITE(b);  \
                } else {                                                                \
                    conflict = differ;                                                  \
                    v = conflict ? mv : o;                                              \
                    c3 += !differ;                                                      \
                    bad += conflict & !FINITE(mv) & FINITE(o) & FINITE(t);              \
                }                                                                       \
                c4 += conflict;                                                         \
                memcpy(out + (size_t)j * sizeof(U), &v, sizeof(U));                     \
            }                                                                           \
            r->counts[0] += c0, r->counts[1] += c1, r->counts[2] += c2;                 \
            r->counts[3] += c3, r->counts[4] += c4;                                     \
            if (bad) {                                                                  \
                r->bad = bad;                                                           \
                break;                                                                  \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
    static inline __attribute__((always_inline)) void NAME##_in(                        \
        pass_t *r, const int s, const int has_base, const params_t *p) {                \
        if (r->out == r->t) NAME##_with(r, s, has_base, 1, p);                          \
        else NAME##_with(r, s, has_base, 0, p);                                         \
    }                                                                                   \
    TARGETS static void NAME(pass_t *r, int s, const params_t *p) {                     \
        if (r->b != NULL) {                                                             \
            if (s == S_AVERAGE) NAME##_in(r, S_AVERAGE, 1, p);                          \
            else if (s == S_TASK) NAME##_in(r, S_TASK, 1, p);                           \
            else NAME##_in(r, S_TIES, 1, p);                                            \
        } else {                                                                        \
            NAME##_in(r, S_AVERAGE, 0, p); /* the only one that needs no base */        \
        }                                                                               \
    }

/* A second build of each pass for AVX2 machines, chosen at load time (twice the lanes
 * of the SSE2 baseline; no FMA is used: -ffp-contract=off). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define TARGETS __attribute__((target_clones("avx2", "default")))
#else
#define TARGETS
#endif

PASS(pass_f32, uint32_t, float, widen_f32, narrow_f32, finite_f32)
PASS(pass_f16, uint16_t, float, widen_f16, narrow_f16, finite_f16)
PASS(pass_bf16, uint16_t, float, widen_bf16, narrow_bf16, finite_bf16)
PASS(pass_f64, uint64_t, double, widen_f64, narrow_f64, finite_f64)

/* A side-picking strategy on units of 1, 2, 4 or 8 bytes of any dtype (no restrict: `out`
 * may be theirs, each unit read before it is written): where both sides
 * changed a unit differently, that side's bits. */
#define PICK(NAME, U)                                                                   \
    static void NAME(pass_t *r, int s) {                                                \
        int64_t c[5] = {0, 0, 0, 0, 0};                                                 \
        for (Py_ssize_t i = 0; i < r->n; i++) {                                         \
            U o, t, b = 0, v;                                                           \
            memcpy(&o, r->o + i * sizeof(U), sizeof(U));                                \
            memcpy(&t, r->t + i * sizeof(U), sizeof(U));                                \
            if (r->b != NULL) {                                                         \
                memcpy(&b, r->b + i * sizeof(U), sizeof(U));                            \
                int oc = o != b, tc = t != b;                                           \
                int cls = (oc && tc) ? (o == t ? 3 : 4) : (oc ? 1 : (tc ? 2 : 0));      \
                c[cls]++;                                                               \
                v = cls == 4 ? (s == S_OURS ? o : (s == S_THEIRS ? t : b)) : (tc ? t : o); \
            } else {                                                                    \
                int cls = o == t ? 3 : 4;                                               \
                c[cls]++;                                                               \
                v = cls == 4 && s == S_THEIRS ? t : o;                                  \
            }                                                                           \
            memcpy(r->out + i * sizeof(U), &v, sizeof(U));                              \
        }                                                                               \
        memcpy(r->counts, c, sizeof(c));                                                \
    }

PICK(pick1, uint8_t)
PICK(pick2, uint16_t)
PICK(pick4, uint32_t)
PICK(pick8, uint64_t)

static int parse_params(PyObject *tuple, params_t *p) {
    memset(p, 0, sizeof(*p));
    p->lam = 1.0;
    if (tuple == Py_None) return 1;
    return PyArg_ParseTuple(tuple, "ddddppidnidn;params", &p->wo, &p->wt, &p->divisor,
                            &p->lam, &p->has_divisor, &p->normalize, &p->cut_o, &p->mag_o,
                            &p->last_o, &p->cut_t, &p->mag_t, &p->last_t);
}

static const Py_ssize_t kind_size[] = {0, 4, 2, 2, 8};

/* Whether two buffers share any byte. */
static int overlap(const Py_buffer *x, const Py_buffer *y) {
    const char *x0 = x->buf, *y0 = y->buf;
    return x->len > 0 && y->len > 0 && x0 < y0 + y->len && y0 < x0 + x->len;
}

/* threeway(out, base, ours, theirs, kind, unit, strategy, params) -> (counts, bad)
 *
 * Fills `out` (writable, the size of `ours`) by the three-way rule; `out` may be
 * `theirs` itself (the merge then needs no fourth tensor-sized buffer), and overlaps
 * no other input. kind 0 with a
 * side-picking strategy works on raw units of `unit` bytes; kinds 1-4 (F32, F16, BF16,
 * F64) with average, task arithmetic or TIES compute the conflicting elements. params:
 * (wo, wt, divisor, lambda, has_divisor, normalize, cut_o, mag_o, last_o, cut_t, mag_t,
 * last_t) or None for a side pick. counts: the five TensorMerge counts; bad: how many
 * elements of the first block that had any came out inf or NaN from finite versions
 * (then the rest of `out` is unspecified). */
static PyObject *threeway(PyObject *self, PyObject *args) {
    Py_buffer out, o, t, b = {0};
    PyObject *base, *ptuple;
    int kind, unit, strategy;
    params_t p;
    if (!PyArg_ParseTuple(args, "w*Oy*y*iiiO", &out, &base, &o, &t, &kind, &unit, &strategy,
                          &ptuple))
        return NULL;
    PyObject *result = NULL;
    int have_b = 0;
    if (base != Py_None) {
        if (PyObject_GetBuffer(base, &b, PyBUF_SIMPLE) < 0) goto done;
        have_b = 1;
    }
    if (!parse_params(ptuple, &p)) goto done;
    int picks = strategy >= S_OURS && strategy <= S_BASE;
    int computes = strategy >= S_AVERAGE && strategy <= S_TIES;
    if (picks ? (kind != 0 || (unit != 1 && unit != 2 && unit != 4 && unit != 8))
              : (!computes || kind < K_F32 || kind > K_F64 || unit != kind_size[kind])) {
        PyErr_SetString(PyExc_ValueError, "unsupported kind, unit or strategy");
        goto done;
    }
    if (out.len != o.len || t.len != o.len || (have_b && b.len != o.len) || o.len % unit) {
        PyErr_SetString(PyExc_ValueError, "buffers differ in size");
        goto done;
    }
    if (!have_b && (strategy == S_BASE || strategy == S_TASK || strategy == S_TIES)) {
        PyErr_SetString(PyExc_ValueError, "this strategy needs the base");
        goto done;
    }
    if (overlap(&out, &o) || (have_b && overlap(&out, &b)) ||
        (overlap(&out, &t) && out.buf != t.buf)) {
        PyErr_SetString(PyExc_ValueError, "out overlaps an input other than theirs");
        goto done;
    }
    pass_t r = {have_b ? b.buf : NULL, o.buf, t.buf, out.buf, o.len / unit, {0}, 0};
    Py_BEGIN_ALLOW_THREADS
    if (picks) {
        switch (unit) {
        case 1: pick1(&r, strategy); break;
        case 2: pick2(&r, strategy); break;
        case 4: pick4(&r, strategy); break;
        default: pick8(&r, strategy); break;
        }
    } else {
        switch (kind) {
        case K_F32: pass_f32(&r, strategy, &p); break;
        case K_F16: pass_f16(&r, strategy, &p); break;
        case K_BF16: pass_bf16(&r, strategy, &p); break;
        default: pass_f64(&r, strategy, &p); break;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(LLLLL)n", (long long)r.counts[0], (long long)r.counts[1],
                           (long long)r.counts[2], (long long)r.counts[3],
                           (long long)r.counts[4], r.bad);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&o);
    PyBuffer_Release(&t);
    if (have_b) PyBuffer_Release(&b);
    return result;
}

/* --- TIES's cut without a tensor-sized scratch ------------------------------------
 * ties.find_cut partitions a copy of |side - base| to find the k-th largest magnitude.
 * Magnitudes are non-negative, so their float32 bit patterns sort as their values do,
 * with NaN above inf as NumPy's partition puts it: a radix select on the bits (two
 * histogram passes of 16 bits, each recomputing the magnitudes) finds the same value
 * with no copy of the tensor (154 MB for GPT-2's embeddings, beside the three versions
 * and the result). */

static inline uint32_t magnitude_bits(const unsigned char *b, const unsigned char *s,
                                      Py_ssize_t i, int kind) {
    float d;
    if (kind == K_F32) {
        uint32_t x, y;
        memcpy(&x, b + i * 4, 4);
        memcpy(&y, s + i * 4, 4);
        d = widen_f32(y) - widen_f32(x);
    } else {
        uint16_t x, y;
        memcpy(&x, b + i * 2, 2);
        memcpy(&y, s + i * 2, 2);
        d = kind == K_F16 ? widen_f16(y) - widen_f16(x) : widen_bf16(y) - widen_bf16(x);
    }
    return bits_of(d) & 0x7fffffffu; /* np.abs */
}

/* One histogram pass: of the high 16 bits (`high`, also counting infinities), or of the
 * low 16 bits of the magnitudes whose high bits are `top`. */
#define CUT_PASS(NAME, KIND)                                                            \
    TARGETS static int64_t NAME(const unsigned char *b, const unsigned char *s,         \
                                Py_ssize_t n, int64_t *hist, int high, uint32_t top) {  \
        int64_t infs = 0;                                                               \
        for (Py_ssize_t i = 0; i < n; i++) {                                            \
            uint32_t m = magnitude_bits(b, s, i, KIND);                                 \
            if (high) {                                                                 \
                hist[m >> 16]++;                                                        \
                infs += m == 0x7f800000u;                                               \
            } else if ((m >> 16) == top) {                                              \
                hist[m & 0xffffu]++;                                                    \
            }                                                                           \
        }                                                                               \
        return infs;                                                                    \
    }

CUT_PASS(cut_pass_f32, K_F32)
CUT_PASS(cut_pass_f16, K_F16)
CUT_PASS(cut_pass_bf16, K_BF16)

static int64_t cut_pass(const unsigned char *b, const unsigned char *s, Py_ssize_t n,
                        int kind, int64_t *hist, int high, uint32_t top) {
    memset(hist, 0, sizeof(int64_t) << 16);
    if (kind == K_F32) return cut_pass_f32(b, s, n, hist, high, top);
    if (kind == K_F16) return cut_pass_f16(b, s, n, hist, high, top);
    return cut_pass_bf16(b, s, n, hist, high, top);
}

/* The bin holding the element of ascending rank `*rank`; `*rank` becomes its rank
 * within the bin. */
static uint32_t find_bin(const int64_t *hist, int64_t *rank) {
    uint32_t bin = 0;
    while (*rank >= hist[bin]) *rank -= hist[bin++];
    return bin;
}

/* cut(base, side, kind, k) -> (magnitude, last): ties.find_cut's Cut keeping the k
 * largest of |side - base| (1 <= k < n), for the float32-working kinds. As there:
 * `above` counts the magnitudes greater than the cut (NaN is greater than none),
 * `equal` those equal to it (none when it is NaN), and the k - above missing ones are
 * the equal ones of lowest index: all of them (last = n - 1), too few (-1), or up to
 * the index of the last one needed. */
static PyObject *cut(PyObject *self, PyObject *args) {
    Py_buffer b, s;
    int kind;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "y*y*in", &b, &s, &kind, &k)) return NULL;
    PyObject *result = NULL;
    int64_t *hist = NULL;
    Py_ssize_t size = (kind >= K_F32 && kind <= K_BF16) ? kind_size[kind] : 0;
    Py_ssize_t n = size ? s.len / size : 0;
    if (!size || b.len != s.len || s.len % size || k < 1 || k >= n) {
        PyErr_SetString(PyExc_ValueError, "unsupported kind, sizes or k");
        goto done;
    }
    hist = PyMem_RawMalloc(sizeof(int64_t) << 16);
    if (hist == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint32_t bits;
    Py_ssize_t last = -1;
    Py_BEGIN_ALLOW_THREADS
    int64_t rank = (int64_t)(n - k); /* np.partition(n - k): the k-th largest */
    int64_t infs = cut_pass(b.buf, s.buf, n, kind, hist, 1, 0);
    int64_t nans = -infs, above = 0;
    for (uint32_t h = 0x7f80; h <= 0x7fff; h++) nans += hist[h]; /* bits above inf's */
    uint32_t top = find_bin(hist, &rank);
    for (uint32_t h = top + 1; h <= 0x7fff; h++) above += hist[h];
    cut_pass(b.buf, s.buf, n, kind, hist, 0, top);
    uint32_t low = find_bin(hist, &rank);
    bits = top << 16 | low;
    for (uint32_t l = low + 1; l <= 0xffff; l++) above += hist[l];
    if (bits <= 0x7f800000u) { /* not NaN: every NaN was counted above it */
        int64_t equal = hist[low], missing = (int64_t)k - (above - nans);
        if (missing > equal) last = -1;
        else if (missing == equal) last = n - 1;
        else {
            for (Py_ssize_t i = 0; i < n; i++)
                if (magnitude_bits(b.buf, s.buf, i, kind) == bits && --missing == 0) {
                    last = i;
                    break;
                }
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("dn", (double)f32_of(bits), last);
done:
    PyMem_RawFree(hist);
    PyBuffer_Release(&b);
    PyBuffer_Release(&s);
    return result;
}

/* conflicts(base, ours, theirs, unit) -> bool: whether some unit of `unit` (1, 2, 4 or
 * 8) bytes changed differently on both sides; stops at the first. TIES asks before its
 * cut, which reads the whole tensor twice per side: a merge with no such unit needs none. */
#define FIRST(NAME, U)                                                                  \
    static int NAME(const unsigned char *b, const unsigned char *o, const unsigned char *t, \
                    Py_ssize_t n) {                                                     \
        for (Py_ssize_t i = 0; i < n; i++) {                                            \
            U x, y, z;                                                                  \
            memcpy(&x, b + i * sizeof(U), sizeof(U));                                   \
            memcpy(&y, o + i * sizeof(U), sizeof(U));                                   \
            memcpy(&z, t + i * sizeof(U), sizeof(U));                                   \
            if (y != x && z != x && y != z) return 1;                                   \
        }                                                                               \
        return 0;                                                                       \
    }

FIRST(first1, uint8_t)
FIRST(first2, uint16_t)
FIRST(first4, uint32_t)
FIRST(first8, uint64_t)

static PyObject *conflicts(PyObject *self, PyObject *args) {
    Py_buffer b, o, t;
    int unit;
    if (!PyArg_ParseTuple(args, "y*y*y*i", &b, &o, &t, &unit)) return NULL;
    PyObject *result = NULL;
    if ((unit != 1 && unit != 2 && unit != 4 && unit != 8) || o.len % unit ||
        b.len != o.len || t.len != o.len) {
        PyErr_SetString(PyExc_ValueError, "unsupported unit or sizes");
        goto done;
    }
    int any;
    Py_ssize_t n = o.len / unit;
    Py_BEGIN_ALLOW_THREADS
    switch (unit) {
    case 1: any = first1(b.buf, o.buf, t.buf, n); break;
    case 2: any = first2(b.buf, o.buf, t.buf, n); break;
    case 4: any = first4(b.buf, o.buf, t.buf, n); break;
    default: any = first8(b.buf, o.buf, t.buf, n); break;
    }
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(any);
done:
    PyBuffer_Release(&b);
    PyBuffer_Release(&o);
    PyBuffer_Release(&t);
    return result;
}

/* narrow(values, kind) -> bytes: float32 `values` rounded to F16 (kind 2) or BF16 (3),
 * for the tests that hold these roundings to NumPy's over many bit patterns. */
static PyObject *narrow(PyObject *self, PyObject *args) {
    Py_buffer in;
    int kind;
    if (!PyArg_ParseTuple(args, "y*i", &in, &kind)) return NULL;
    if ((kind != K_F16 && kind != K_BF16) || in.len % 4) {
        PyErr_SetString(PyExc_ValueError, "unsupported kind or length");
        PyBuffer_Release(&in);
        return NULL;
    }
    Py_ssize_t n = in.len / 4;
    PyObject *res = PyBytes_FromStringAndSize(NULL, n * 2);
    if (res != NULL) {
        const unsigned char *src = in.buf;
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(res);
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, src + i * 4, 4);
            uint16_t h = kind == K_F16 ? narrow_f16(f32_of(u)) : narrow_bf16(f32_of(u));
            memcpy(dst + i * 2, &h, 2);
        }
    }
    PyBuffer_Release(&in);
    return res;
}

/* --- a side's value from the base and its delta, out of place --------------------- */

/* The words of a value are little-endian (updates/delta.py), the arithmetic native. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define LE16(w) __builtin_bswap16(w)
#define LE32(w) __builtin_bswap32(w)
#define LE64(w) __builtin_bswap64(w)
#else
#define LE16(w) (w)
#define LE32(w) (w)
#define LE64(w) (w)
#endif
#define LE8(w) (w)

/* out = base + unfold(z) per word, wrapping: _planes.unzigzag_add's bits, written to a
 * third buffer. A merge keeps the base for the other side and the merge step, so the
 * in-place form needed a copy of it first: a whole extra pass over every tensor. */
#define ADD_DELTA(NAME, U, LE)                                                          \
    TARGETS static void NAME(unsigned char *restrict out, const unsigned char *restrict base, \
                             const unsigned char *restrict pz, Py_ssize_t n) {          \
        for (Py_ssize_t i = 0; i < n; i++) {                                            \
            U z, b;                                                                     \
            memcpy(&z, pz + i * sizeof(U), sizeof(U));                                  \
            memcpy(&b, base + i * sizeof(U), sizeof(U));                                \
            z = LE(z);                                                                  \
            U d = (U)((U)(z >> 1) ^ (U)(0 - (U)(z & 1)));                               \
            U v = LE((U)(LE(b) + d));                                                   \
            memcpy(out + i * sizeof(U), &v, sizeof(U));                                 \
        }                                                                               \
    }

ADD_DELTA(add_delta1, uint8_t, LE8)
ADD_DELTA(add_delta2, uint16_t, LE16)
ADD_DELTA(add_delta4, uint32_t, LE32)
ADD_DELTA(add_delta8, uint64_t, LE64)

/* add_delta(out, base, z, word): out = base + unfold(z), per word of 1, 2, 4 or 8 bytes
 * (wrapping); the three the same length, whole words. `out` may not overlap the others. */
static PyObject *add_delta(PyObject *self, PyObject *args) {
    Py_buffer out, b, z;
    int word;
    if (!PyArg_ParseTuple(args, "w*y*y*i", &out, &b, &z, &word)) return NULL;
    PyObject *result = NULL;
    if (word != 1 && word != 2 && word != 4 && word != 8) {
        PyErr_Format(PyExc_ValueError, "word must be 1, 2, 4 or 8, not %d", word);
        goto done;
    }
    if (out.len != b.len || z.len != b.len || b.len % word) {
        PyErr_SetString(PyExc_ValueError, "values differ in length or are not whole words");
        goto done;
    }
    if (overlap(&out, &b) || overlap(&out, &z)) {
        PyErr_SetString(PyExc_ValueError, "out overlaps an input");
        goto done;
    }
    Py_ssize_t n = b.len / word;
    Py_BEGIN_ALLOW_THREADS
    switch (word) {
    case 1: add_delta1(out.buf, b.buf, z.buf, n); break;
    case 2: add_delta2(out.buf, b.buf, z.buf, n); break;
    case 4: add_delta4(out.buf, b.buf, z.buf, n); break;
    default: add_delta8(out.buf, b.buf, z.buf, n); break;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&b);
    PyBuffer_Release(&z);
    return result;
}

static PyMethodDef methods[] = {
    {"threeway", threeway, METH_VARARGS, "The element-wise three-way merge of one tensor."},
    {"conflicts", conflicts, METH_VARARGS, "Whether both sides changed a unit differently."},
    {"cut", cut, METH_VARARGS, "TIES's cut of |side - base|: (magnitude, last)."},
    {"narrow", narrow, METH_VARARGS, "float32 values rounded to F16 or BF16 bits."},
    {"add_delta", add_delta, METH_VARARGS, "out = base + the unfolded zigzag delta z."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_merge", NULL, -1, methods};

PyMODINIT_FUNC PyInit__merge(void) { return PyModule_Create(&module); }
