/* Byte-plane split and join for the codec, in one pass over the data (and the delta
 * update's zigzag difference, below).
 *
 * A word is read little-endian, optionally rotated left by one bit (the sign moves below
 * the mantissa), and byte k of it, most significant first, goes to plane k. NumPy needs
 * one pass per plane plus three for the rotation; on a 2-core machine that was a third
 * of checkout time. The loops run without the GIL so chunks decode in parallel threads.
 * codec.py keeps a NumPy version of both for builds without a C compiler, and the tests
 * check the two agree byte for byte.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <errno.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#define HUGE ((uintptr_t)2 << 20)

#define PLANES_MAX 8

static inline uint64_t load_le(const unsigned char *p, int word) {
    uint64_t w = 0;
    for (int k = word - 1; k >= 0; k--) w = (w << 8) | p[k];
    return w;
}

/* The joins GCC can vectorise: fixed-width words, no data-dependent branches. The
 * generic loop above this ran at ~1 GB/s; these are what checkout spends its time in. */
#define JOIN_FIXED(NAME, T, WORD)                                                       \
    static void NAME(unsigned char *restrict dst, const unsigned char *const *src,      \
                     Py_ssize_t n, int rotate) {                                        \
        const unsigned char *p[WORD];                                                   \
        for (int k = 0; k < (WORD); k++) p[k] = src[k];                                 \
        if (rotate) {                                                                   \
            for (Py_ssize_t i = 0; i < n; i++) {                                        \
                T w = 0;                                                                \
                for (int k = 0; k < (WORD); k++) w = (T)((w << 8) | p[k][i]);           \
                w = (T)((w >> 1) | (w << ((WORD) * 8 - 1)));                            \
                w = LE_##WORD(w);                                                       \
                memcpy(dst + i * (WORD), &w, (WORD));                                   \
            }                                                                           \
        } else {                                                                        \
            for (Py_ssize_t i = 0; i < n; i++) {                                        \
                T w = 0;                                                                \
                for (int k = 0; k < (WORD); k++) w = (T)((w << 8) | p[k][i]);           \
                w = LE_##WORD(w);                                                       \
                memcpy(dst + i * (WORD), &w, (WORD));                                   \
            }                                                                           \
        }                                                                               \
    }

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define LE_2(w) __builtin_bswap16(w)
#define LE_4(w) __builtin_bswap32(w)
#define LE_8(w) __builtin_bswap64(w)
#else
#define LE_2(w) (w)
#define LE_4(w) (w)
#define LE_8(w) (w)
#endif

JOIN_FIXED(join2, uint16_t, 2)
JOIN_FIXED(join4, uint32_t, 4)
JOIN_FIXED(join8, uint64_t, 8)

#define SPLIT_FIXED(NAME, T, WORD)                                                      \
    static void NAME(unsigned char *const *dst, const unsigned char *restrict src,     \
                     Py_ssize_t n, int rotate) {                                        \
        unsigned char *p[WORD];                                                         \
        for (int k = 0; k < (WORD); k++) p[k] = dst[k];                                 \
        for (Py_ssize_t i = 0; i < n; i++) {                                            \
            T w;                                                                        \
            memcpy(&w, src + i * (WORD), (WORD));                                       \
            w = LE_##WORD(w);                                                           \
            if (rotate) w = (T)((w << 1) | (w >> ((WORD) * 8 - 1)));                     \
            for (int k = 0; k < (WORD); k++) p[k][i] = (unsigned char)(w >> (8 * ((WORD) - 1 - k))); \
        }                                                                               \
    }

SPLIT_FIXED(split2, uint16_t, 2)
SPLIT_FIXED(split4, uint32_t, 4)
SPLIT_FIXED(split8, uint64_t, 8)


static int check_word(int word) {
    if (word != 2 && word != 4 && word != 8) {
        PyErr_Format(PyExc_ValueError, "word must be 2, 4 or 8, not %d", word);
        return 0;
    }
    return 1;
}

/* split(data, word, rotate) -> list of `word` bytes objects, most significant first. */
static PyObject *split(PyObject *self, PyObject *args) {
    Py_buffer in;
    int word, rotate;
    if (!PyArg_ParseTuple(args, "y*ip", &in, &word, &rotate)) return NULL;
    if (!check_word(word) || in.len % word) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "length is not a multiple of the word");
        PyBuffer_Release(&in);
        return NULL;
    }
    Py_ssize_t n = in.len / word;
    PyObject *list = PyList_New(word);
    if (list == NULL) {
        PyBuffer_Release(&in);
        return NULL;
    }
    unsigned char *dst[PLANES_MAX];
    for (int k = 0; k < word; k++) {
        PyObject *plane = PyBytes_FromStringAndSize(NULL, n);
        if (plane == NULL) {
            Py_DECREF(list);
            PyBuffer_Release(&in);
            return NULL;
        }
        dst[k] = (unsigned char *)PyBytes_AS_STRING(plane);
        PyList_SET_ITEM(list, k, plane);
    }
    const unsigned char *src = in.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (word) {
    case 2: split2(dst, src, n, rotate); break;
    case 4: split4(dst, src, n, rotate); break;
    default: split8(dst, src, n, rotate); break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&in);
    return list;
}

/* join(out, planes, word, rotate): the inverse of split, written into `out`. */
static PyObject *join(PyObject *self, PyObject *args) {
    Py_buffer out;
    PyObject *seq;
    int word, rotate;
    if (!PyArg_ParseTuple(args, "w*Oip", &out, &seq, &word, &rotate)) return NULL;
    Py_buffer planes[PLANES_MAX];
    int held = 0;
    PyObject *result = NULL;
    if (!check_word(word) || out.len % word) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "length is not a multiple of the word");
        goto done;
    }
    Py_ssize_t n = out.len / word;
    if (!PySequence_Check(seq) || PySequence_Size(seq) != word) {
        PyErr_SetString(PyExc_ValueError, "need one plane per byte of the word");
        goto done;
    }
    const unsigned char *src[PLANES_MAX];
    for (; held < word; held++) {
        PyObject *item = PySequence_GetItem(seq, held);
        if (item == NULL) goto done;
        int rc = PyObject_GetBuffer(item, &planes[held], PyBUF_SIMPLE);
        Py_DECREF(item);
        if (rc < 0) goto done;
        if (planes[held].len != n) {
            held++;
            PyErr_SetString(PyExc_ValueError, "plane length does not match the output");
            goto done;
        }
        src[held] = planes[held].buf;
    }
    unsigned char *dst = out.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (word) {
    case 2: join2(dst, src, n, rotate); break;
    case 4: join4(dst, src, n, rotate); break;
    default: join8(dst, src, n, rotate); break;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (int k = 0; k < held; k++) PyBuffer_Release(&planes[k]);
    PyBuffer_Release(&out);
    return result;
}

/* counts[b]: how many of every step-th byte of p[0..len) are b (step >= 1). Four
 * tables, summed: a skewed plane repeats a few bytes, and one table's counter made every
 * sample wait on its own last increment. */
static void sample_counts(const unsigned char *p, Py_ssize_t len, Py_ssize_t step,
                          Py_ssize_t counts[256]) {
    uint64_t part[4][256] = {{0}};
    if (step > len) step = len > 0 ? len : 1; /* the same sample; no overflow below */
    Py_ssize_t i = 0, stride = 4 * step;
    for (; len > 3 * step && i < len - 3 * step; i += stride) {
        part[0][p[i]]++;
        part[1][p[i + step]]++;
        part[2][p[i + 2 * step]]++;
        part[3][p[i + 3 * step]]++;
    }
    for (; i < len; i += step) part[0][p[i]]++;
    for (int b = 0; b < 256; b++)
        counts[b] = (Py_ssize_t)(part[0][b] + part[1][b] + part[2][b] + part[3][b]);
}

/* (data, step) of histogram and entropy_bits: 0 with an exception set when they are
 * not a buffer and a step of at least 1. */
static int sample_args(PyObject *args, Py_buffer *in, Py_ssize_t *step) {
    if (!PyArg_ParseTuple(args, "y*n", in, step)) return 0;
    if (*step < 1) {
        PyBuffer_Release(in);
        PyErr_SetString(PyExc_ValueError, "step must be at least 1");
        return 0;
    }
    return 1;
}

/* histogram(data, step) -> list of 256 counts of every step-th byte. */
static PyObject *histogram(PyObject *self, PyObject *args) {
    Py_buffer in;
    Py_ssize_t step;
    if (!sample_args(args, &in, &step)) return NULL;
    Py_ssize_t counts[256];
    Py_BEGIN_ALLOW_THREADS
    sample_counts(in.buf, in.len, step, counts);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&in);
    PyObject *list = PyList_New(256);
    if (list == NULL) return NULL;
    for (int b = 0; b < 256; b++) {
        PyObject *v = PyLong_FromSsize_t(counts[b]);
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, b, v);
    }
    return list;
}

/* The correctly rounded sum of x[0..n) (Shewchuk's partials, as math.fsum sums: any
 * correctly rounded sum of the same doubles is the same double), or NAN when more than
 * PARTIALS partials would be needed (the caller then sums in Python). */
#define PARTIALS 64
static double exact_sum(const double *x, int n) {
    double p[PARTIALS];
    int np = 0;
    for (int i = 0; i < n; i++) {
        double v = x[i];
        int k = 0;
        for (int j = 0; j < np; j++) {
            double y = p[j];
            if (fabs(v) < fabs(y)) {
                double t = v;
                v = y;
                y = t;
            }
            double hi = v + y;
            double lo = y - (hi - v);
            if (lo != 0.0) p[k++] = lo;
            v = hi;
        }
        if (k >= PARTIALS) return NAN;
        np = k;
        p[np++] = v;
    }
    double hi = 0.0;
    if (np > 0) {
        double lo = 0.0;
        hi = p[--np];
        while (np > 0) { /* the top partials, until one is not exact */
            double a = hi, y = p[--np];
            hi = a + y;
            lo = y - (hi - a);
            if (lo != 0.0) break;
        }
        /* Round half to even across the rest: the next partial says which way a tie
         * between hi and its neighbour really lies. */
        if (np > 0 && ((lo < 0.0 && p[np - 1] < 0.0) || (lo > 0.0 && p[np - 1] > 0.0))) {
            double y = lo * 2.0, a = hi + y;
            if (y == a - hi) hi = a;
        }
    }
    return hi;
}

/* entropy_bits(data, step) -> float, the order-0 entropy (bits per byte) of every
 * step-th byte: codec._entropy_bits's formula, -fsum(c/n * log2(c/n)) over the nonzero
 * counts in byte order, term by term the same doubles, summed correctly rounded as
 * math.fsum sums them; None when the sum needs Python's (never for 256 terms in
 * [-0.531, 0], but not assumed). Python's loop over the counts cost a fifth of a delta
 * encode. */
static PyObject *entropy_bits(PyObject *self, PyObject *args) {
    Py_buffer in;
    Py_ssize_t step;
    if (!sample_args(args, &in, &step)) return NULL;
    Py_ssize_t counts[256], total = 0;
    double terms[256];
    int n = 0;
    double sum;
    Py_BEGIN_ALLOW_THREADS
    sample_counts(in.buf, in.len, step, counts);
    for (int b = 0; b < 256; b++) total += counts[b];
    for (int b = 0; b < 256; b++) {
        if (!counts[b]) continue;
        double x = (double)counts[b] / (double)total;
        terms[n++] = x * log2(x);
    }
    sum = exact_sum(terms, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&in);
    if (isnan(sum)) Py_RETURN_NONE;
    return PyFloat_FromDouble(-sum);
}


/* Fixed word sizes again, so the loads and stores compile to plain moves. */
/* Fixed-width loops GCC vectorises (the byte-generic ones ran at ~1 GB/s): unsigned
 * arithmetic of the word's own width wraps exactly like the bit-pattern difference. */
#define ZIGZAG_FIXED(NAME, T, WORD)                                                     \
    static void NAME(unsigned char *restrict dst, const unsigned char *restrict pn,    \
                     const unsigned char *restrict po, Py_ssize_t n) {                  \
        for (Py_ssize_t i = 0; i < n; i++) {                                            \
            T a, b;                                                                     \
            memcpy(&a, pn + i * (WORD), (WORD));                                        \
            memcpy(&b, po + i * (WORD), (WORD));                                        \
            T d = (T)(LE_##WORD(a) - LE_##WORD(b));                                      \
            T z = (T)((T)(d << 1) ^ (T)(0 - (T)(d >> ((WORD) * 8 - 1))));               \
            z = LE_##WORD(z);                                                           \
            memcpy(dst + i * (WORD), &z, (WORD));                                       \
        }                                                                               \
    }

#define UNZIGZAG_FIXED(NAME, T, WORD)                                                   \
    static void NAME(unsigned char *restrict pv, const unsigned char *restrict pz,     \
                     Py_ssize_t n) {                                                    \
        for (Py_ssize_t i = 0; i < n; i++) {                                            \
            T z, v;                                                                     \
            memcpy(&z, pz + i * (WORD), (WORD));                                        \
            memcpy(&v, pv + i * (WORD), (WORD));                                        \
            z = LE_##WORD(z);                                                           \
            T d = (T)((T)(z >> 1) ^ (T)(0 - (T)(z & 1)));                               \
            v = LE_##WORD((T)(LE_##WORD(v) + d));                                       \
            memcpy(pv + i * (WORD), &v, (WORD));                                        \
        }                                                                               \
    }

#define LE_1(w) (w)
ZIGZAG_FIXED(zigzag1, uint8_t, 1)
ZIGZAG_FIXED(zigzag2, uint16_t, 2)
ZIGZAG_FIXED(zigzag4, uint32_t, 4)
ZIGZAG_FIXED(zigzag8, uint64_t, 8)
UNZIGZAG_FIXED(unzigzag1, uint8_t, 1)
UNZIGZAG_FIXED(unzigzag2, uint16_t, 2)
UNZIGZAG_FIXED(unzigzag4, uint32_t, 4)
UNZIGZAG_FIXED(unzigzag8, uint64_t, 8)

static int check_delta_word(int word) {
    if (word != 1 && word != 2 && word != 4 && word != 8) {
        PyErr_Format(PyExc_ValueError, "word must be 1, 2, 4 or 8, not %d", word);
        return 0;
    }
    return 1;
}

/* zigzag(new, old, word) -> bytes: per word, the wrapping difference new - old of the
 * bit patterns, zigzag-folded (0, -1, 1, -2... -> 0, 1, 2, 3...) so small changes either
 * way are small numbers. */
static PyObject *zigzag(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    int word;
    if (!PyArg_ParseTuple(args, "y*y*i", &a, &b, &word)) return NULL;
    PyObject *result = NULL;
    if (!check_delta_word(word)) goto done;
    if (a.len != b.len || a.len % word) {
        PyErr_SetString(PyExc_ValueError, "values differ in length or are not whole words");
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, a.len);
    if (result == NULL) goto done;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(result);
    const unsigned char *pn = a.buf, *po = b.buf;
    Py_ssize_t n = a.len / word;
    Py_BEGIN_ALLOW_THREADS
    switch (word) {
    case 1: zigzag1(dst, pn, po, n); break;
    case 2: zigzag2(dst, pn, po, n); break;
    case 4: zigzag4(dst, pn, po, n); break;
    default: zigzag8(dst, pn, po, n); break;
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return result;
}

/* unzigzag_add(value, z, word): value += unfold(z), per word, wrapping; in place. */
static PyObject *unzigzag_add(PyObject *self, PyObject *args) {
    Py_buffer v, z;
    int word;
    if (!PyArg_ParseTuple(args, "w*y*i", &v, &z, &word)) return NULL;
    PyObject *result = NULL;
    if (!check_delta_word(word)) goto done;
    if (v.len != z.len || v.len % word) {
        PyErr_SetString(PyExc_ValueError, "values differ in length or are not whole words");
        goto done;
    }
    unsigned char *pv = v.buf;
    const unsigned char *pz = z.buf;
    Py_ssize_t n = v.len / word;
    Py_BEGIN_ALLOW_THREADS
    switch (word) {
    case 1: unzigzag1(pv, pz, n); break;
    case 2: unzigzag2(pv, pz, n); break;
    case 4: unzigzag4(pv, pz, n); break;
    default: unzigzag8(pv, pz, n); break;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&v);
    PyBuffer_Release(&z);
    return result;
}

/* empty(n) -> a bytearray of n bytes left uninitialised: every caller overwrites all of
 * it, and zeroing hundreds of megabytes first cost a tenth of a checkout. */
static PyObject *empty(PyObject *self, PyObject *args) {
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "n", &n)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "size must not be negative");
        return NULL;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n);
#ifdef MADV_HUGEPAGE
    /* A fresh large buffer is untouched memory: faulting it in 4 KiB pages cost 30-60 ms
     * per 45-90 MB tensor on a VM, as much as decoding it. Ask for 2 MiB pages on the
     * aligned middle part (a hint: where transparent huge pages are off, nothing changes). */
    if (out != NULL && n >= (Py_ssize_t)(4 << 20)) {
        uintptr_t start = (uintptr_t)PyByteArray_AS_STRING(out);
        uintptr_t lo = (start + HUGE - 1) & ~(uintptr_t)(HUGE - 1);
        uintptr_t hi = (start + (uintptr_t)n) & ~(uintptr_t)(HUGE - 1);
        if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
    }
#endif
    return out;
}

/* prefault(buffer, start, end) -> whether the kernel did it: the pages of
 * buffer[start:end] are made present and writable now (MADV_POPULATE_WRITE, Linux 5.14+),
 * without the GIL. A fresh buffer that a pipe is read into would otherwise take each page
 * fault inside the kernel's pipe read, holding the pipe's lock, while git's write spins on
 * it: a 47 MB tensor's faults cost a tenth of an add's CPU that way. Called on a helper
 * thread ahead of the reader, the zeroing happens beside the copying. Elsewhere (another
 * OS, an older kernel) nothing is done and the reader faults the pages in itself. */
static PyObject *prefault(PyObject *self, PyObject *args) {
    Py_buffer b;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "w*nn", &b, &start, &end)) return NULL;
    int done = 0;
    if (start < 0) start = 0;
    if (end > b.len) end = b.len;
#ifdef MADV_POPULATE_WRITE
    if (end > start) {
        long page = sysconf(_SC_PAGESIZE);
        uintptr_t lo = (uintptr_t)b.buf + (uintptr_t)start;
        uintptr_t hi = (uintptr_t)b.buf + (uintptr_t)end;
        /* Whole pages inside the range only: a page shared with other memory is left to
         * be faulted by whoever writes it (populating it is harmless, but not ours). */
        lo = (lo + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
        hi &= ~((uintptr_t)page - 1);
        if (hi > lo) {
            int rc;
            Py_BEGIN_ALLOW_THREADS
            rc = madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
            Py_END_ALLOW_THREADS
            done = rc == 0;
        }
    }
#endif
    PyBuffer_Release(&b);
    return PyBool_FromLong(done);
}

static int hex_digit(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

#define PKT_MAX_PAYLOAD 65516

/* read_packets(fd, out, left) -> (filled, left, ended): git's content stream (pkt-line
 * packets up to a flush) read straight into out, without the GIL: `left` payload bytes
 * of the packet in progress first, then packet after packet. Stops when out is full
 * (returning how much of the last packet is still to come), or at the flush (ended).
 * EOFError when the stream ends first; ValueError for a length that is not four hex
 * digits or not a packet's. One call per tensor instead of a Python loop of two reads
 * per 64 KiB packet. A signal that interrupts a read runs its Python handler (with the
 * GIL taken back) and the read resumes; a handler that raises ends the call (the stream
 * is then out of step: the filter is being stopped). */
static PyObject *read_packets(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer out;
    Py_ssize_t left;
    if (!PyArg_ParseTuple(args, "iw*n", &fd, &out, &left)) return NULL;
    if (left < 0 || left > PKT_MAX_PAYLOAD) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "left is not a packet's remaining length");
        return NULL;
    }
    unsigned char *dst = out.buf;
    Py_ssize_t room = out.len, filled = 0, have = 0; /* have: bytes of a length read */
    int ended = 0, err = 0, eof = 0, bad = 0, interrupted;
    unsigned char head[4];
    do {
        interrupted = 0;
        Py_BEGIN_ALLOW_THREADS
        while (filled < room) {
            ssize_t r;
            if (left == 0) {
                while (have < 4) {
                    r = read(fd, head + have, (size_t)(4 - have));
                    if (r <= 0) break;
                    have += r;
                }
                if (have < 4) {
                    if (r == 0) eof = 1;
                    else if (errno == EINTR) interrupted = 1;
                    else err = errno;
                    break;
                }
                have = 0;
                int size = 0;
                for (int k = 0; k < 4; k++) {
                    int d = hex_digit(head[k]);
                    if (d < 0) { bad = -1; break; }
                    size = size * 16 + d;
                }
                if (bad) break;
                if (size == 0) { ended = 1; break; }
                if (size < 4 || size - 4 > PKT_MAX_PAYLOAD) { bad = size; break; }
                left = size - 4;
                if (left == 0) continue; /* an empty data packet: legal, carries nothing */
            }
            Py_ssize_t take = left < room - filled ? left : room - filled;
            r = read(fd, dst + filled, (size_t)take);
            if (r <= 0) {
                if (r == 0) eof = 1;
                else if (errno == EINTR) interrupted = 1;
                else err = errno;
                break;
            }
            filled += r;
            left -= r;
        }
        Py_END_ALLOW_THREADS
    } while (interrupted && PyErr_CheckSignals() == 0);
    PyBuffer_Release(&out);
    if (interrupted) return NULL; /* a handler raised (KeyboardInterrupt...) */
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (eof) {
        PyErr_SetString(PyExc_EOFError, "pkt-line stream ended early");
        return NULL;
    }
    if (bad) {
        if (bad > 0) return PyErr_Format(PyExc_ValueError, "bad pkt-line length %d", bad);
        PyObject *text = PyBytes_FromStringAndSize((const char *)head, 4);
        if (text != NULL) {
            PyErr_Format(PyExc_ValueError, "bad pkt-line length %R", text);
            Py_DECREF(text);
        }
        return NULL;
    }
    return Py_BuildValue("nnO", filled, left, ended ? Py_True : Py_False);
}

/* keep_freed_memory() -> whether it applied: from now on malloc serves blocks up to 32 MiB
 * from one arena's heap and keeps what is freed, so memory a process is done with (a
 * tensor hashed and found unchanged, a value encoded) is what its next buffers reuse, at
 * any size, instead of fresh pages (a fault and zeroing each). Larger blocks are still
 * mapped and unmapped on their own: kept in the heap, a large tensor's pages were held
 * past their use and raised an add's peak. Only for a process that ends with its command
 * (the filter, the merge driver). glibc only; elsewhere nothing changes. */
static PyObject *keep_freed_memory(PyObject *self, PyObject *noargs) {
#if defined(__GLIBC__)
    int ok = mallopt(M_ARENA_MAX, 1) && mallopt(M_MMAP_THRESHOLD, 32 << 20) &&
             mallopt(M_TRIM_THRESHOLD, 128 << 20);
    return PyBool_FromLong(ok);
#else
    Py_RETURN_FALSE;
#endif
}

/* scatter(value, gaps, values, size): the sparse update, in place. Positions are the
 * running sum of the little-endian u64 gaps; element k of values (size bytes) is copied
 * to its position. A position past the end raises IndexError before anything is left
 * half-checked: positions are validated as they are used, and the caller discards value. */
static PyObject *scatter(PyObject *self, PyObject *args) {
    Py_buffer v, g, x;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "w*y*y*n", &v, &g, &x, &size)) return NULL;
    PyObject *result = NULL;
    if (size < 1 || v.len % size || g.len % 8 || x.len != (g.len / 8) * size) {
        PyErr_SetString(PyExc_ValueError, "sparse update lengths do not match");
        goto done;
    }
    unsigned char *pv = v.buf;
    const unsigned char *pg = g.buf, *px = x.buf;
    Py_ssize_t count = g.len / 8;
    uint64_t n = (uint64_t)(v.len / size), pos = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < count; k++) {
        uint64_t gap = load_le(pg + k * 8, 8);
        if (k == 0 ? gap >= n : gap >= n - pos) {
            bad = 1;
            break;
        }
        pos += gap;
        memcpy(pv + pos * (uint64_t)size, px + k * size, (size_t)size);
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "sparse update touches elements past the tensor's end");
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&v);
    PyBuffer_Release(&g);
    PyBuffer_Release(&x);
    return result;
}

/* Widen one element to double, exactly. kind: 0 F32, 1 F64, 2 F16, 3 BF16 (dtypes.py
 * FLOAT_KINDS, shared by diff_stats and factored). */
static inline double widen(const unsigned char *p, int kind) {
    if (kind == 0) {
        uint32_t bits = (uint32_t)load_le(p, 4);
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    if (kind == 1) {
        uint64_t bits = load_le(p, 8);
        double d;
        memcpy(&d, &bits, 8);
        return d;
    }
    if (kind == 3) {
        uint32_t bits = (uint32_t)load_le(p, 2) << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    uint32_t h = (uint32_t)load_le(p, 2);
    int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    double v = exp == 0 ? ldexp(mant, -24)
             : exp == 31 ? (mant ? NAN : INFINITY)
             : ldexp(mant + 1024, exp - 25);
    return (h >> 15) ? -v : v;
}

/* diff_stats(old, new, kind) -> (changed, sum of d^2, max |d|, sum of old^2), d = new - old
 * in double, over finite d (and finite old for the norm); changed counts elements whose
 * bits differ. One pass, for `git theta diff` of float tensors without NumPy. */
static PyObject *diff_stats(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    int kind;
    if (!PyArg_ParseTuple(args, "y*y*i", &a, &b, &kind)) return NULL;
    PyObject *result = NULL;
    int size = kind == 0 ? 4 : kind == 1 ? 8 : 2;
    if (kind < 0 || kind > 3 || a.len != b.len || a.len % size) {
        PyErr_SetString(PyExc_ValueError, "diff_stats: bad kind or lengths");
        goto done;
    }
    const unsigned char *pa = a.buf, *pb = b.buf;
    Py_ssize_t n = a.len / size, changed = 0;
    double d2 = 0, maxabs = 0, x2 = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *ea = pa + i * size, *eb = pb + i * size;
        if (memcmp(ea, eb, (size_t)size) != 0) changed++;
        double x = widen(ea, kind), y = widen(eb, kind), d = y - x;
        if (isfinite(d)) {
            d2 += d * d;
            if (fabs(d) > maxabs) maxabs = fabs(d);
        }
        if (isfinite(x)) x2 += x * x;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nddd", changed, d2, maxabs, x2);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return result;
}


/* --- low-rank and ia3 reproduction --------------------------------------------------
 * The NumPy definition (updates/factored.py, `reproduce`) is the reference: values are
 * widened to float64, the change is summed one rank at a time starting from +0.0, then
 * base + scale * change is rounded to the tensor's dtype. The same IEEE operations in the
 * same order give the same bits (setup.py builds with -ffp-contract=off, so no fused
 * multiply-add). Any NaN among the inputs returns None and the NumPy path runs instead:
 * which NaN payload survives an operation is not worth reproducing. */

enum { F32 = 0, F64 = 1, F16 = 2, BF16 = 3 }; /* the kinds widen() takes */

static int float_size(int code) { return code == F64 ? 8 : code == F32 ? 4 : 2; }

static double load_double(const unsigned char *p, Py_ssize_t i, int code) {
    return widen(p + i * float_size(code), code);
}

/* Widen n values to float64; 0 when one is NaN (or on allocation failure, with error). */
static double *widen_all(const unsigned char *p, Py_ssize_t n, int code, int *nan) {
    double *out = PyMem_RawMalloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    if (out == NULL) { PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = load_double(p, i, code);
        if (isnan(out[i])) *nan = 1;
    }
    return out;
}

static void store_rounded(unsigned char *p, Py_ssize_t i, double v, int code) {
    if (code == F64) {
        uint64_t bits;
        memcpy(&bits, &v, 8);
        bits = LE_8(bits);
        memcpy(p + 8 * i, &bits, 8);
        return;
    }
    float f = (float)v;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if (code == F32) {
        bits = LE_4(bits);
        memcpy(p + 4 * i, &bits, 4);
        return;
    }
    uint16_t h = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16); /* BF16, RNE */
    h = LE_2(h);
    memcpy(p + 2 * i, &h, 2);
}

/* The low-rank products a row at a time, the rank loop outside the column loop: each
 * element still gets the same operations in the same order (from +0.0, rank 0 first),
 * and the columns vectorise. Built twice on x86-64, the second for CPUs with AVX2 and
 * FMA (chosen at run time): without FMA instructions every fmaf is a libm call, which
 * made the torch-steps rebuild several times slower. The results are the same bits either way
 * (fmaf is one rounding wherever it runs; -ffp-contract=off fuses nothing else). */
#define LOWRANK_ROWS(SUFFIX, ATTR)                                                        \
    ATTR static void steps_row##SUFFIX(float *restrict acc, const float *restrict ra,     \
                                       const float *restrict vb, Py_ssize_t rank,         \
                                       Py_ssize_t cols) {                                 \
        for (Py_ssize_t j = 0; j < cols; j++) acc[j] = 0.0f;                              \
        for (Py_ssize_t k = 0; k < rank; k++) {                                           \
            const float a = ra[k];                                                        \
            const float *restrict bk = vb + k * cols;                                     \
            for (Py_ssize_t j = 0; j < cols; j++) acc[j] = fmaf(a, bk[j], acc[j]);        \
        }                                                                                 \
    }                                                                                     \
    ATTR static void change_row##SUFFIX(double *restrict acc, const double *restrict ra,  \
                                        const double *restrict vb, Py_ssize_t rank,       \
                                        Py_ssize_t cols) {                                \
        for (Py_ssize_t j = 0; j < cols; j++) acc[j] = 0.0;                               \
        for (Py_ssize_t k = 0; k < rank; k++) {                                           \
            const double a = ra[k];                                                       \
            const double *restrict bk = vb + k * cols;                                    \
            for (Py_ssize_t j = 0; j < cols; j++) acc[j] += a * bk[j];                    \
        }                                                                                 \
    }
LOWRANK_ROWS(_plain, )
typedef void (*steps_row_fn)(float *, const float *, const float *, Py_ssize_t, Py_ssize_t);
typedef void (*change_row_fn)(double *, const double *, const double *, Py_ssize_t, Py_ssize_t);
#if defined(__x86_64__) && defined(__GNUC__)
LOWRANK_ROWS(_fma, __attribute__((target("avx2,fma"))))
static int has_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
static steps_row_fn steps_row(void) { return has_fma() ? steps_row_fma : steps_row_plain; }
static change_row_fn change_row(void) { return has_fma() ? change_row_fma : change_row_plain; }
#else
static steps_row_fn steps_row(void) { return steps_row_plain; }
static change_row_fn change_row(void) { return change_row_plain; }
#endif

/* factored(prev, code, rows, cols, a, acode, b, bcode, rank, scale) -> bytes or None.
 * rank > 0: low-rank, a is R (rows x rank), b is C (rank x cols), value + scale * R @ C.
 * rank == 0: ia3, a is a vector of rows or cols scales (b unused), value * vector. */
static PyObject *factored(PyObject *self, PyObject *args) {
    Py_buffer prev, a, b;
    int code, acode, bcode;
    Py_ssize_t rows, cols, rank;
    double scale;
    if (!PyArg_ParseTuple(args, "y*inny*iy*ind", &prev, &code, &rows, &cols, &a, &acode, &b,
                          &bcode, &rank, &scale))
        return NULL;
    PyObject *result = NULL;
    double *va = NULL, *vb = NULL;
    int nan = 0;
    /* Sizes come from an update object's header: bound them before multiplying. */
    if (code < F32 || code > BF16 || acode < F32 || acode > BF16 || bcode < F32 ||
        bcode > BF16 || rows < 0 || cols < 0 || rank < 0 || rank > a.len ||
        rows > prev.len || cols > prev.len || /* (also an empty tensor: NumPy decides) */
        (rows && cols > prev.len / rows) || prev.len != rows * cols * float_size(code)) {
        PyErr_SetString(PyExc_ValueError, "factored: bad dtype code or sizes");
        goto done;
    }
    if (a.len % float_size(acode) || (rank && b.len % float_size(bcode))) {
        PyErr_SetString(PyExc_ValueError, "factored: factors are not whole values");
        goto done;
    }
    Py_ssize_t na = a.len / float_size(acode), nb = rank ? b.len / float_size(bcode) : 0;
    if (rank ? (na / rank != rows || na % rank || nb / rank != cols || nb % rank)
             : (na != rows && na != cols)) {
        PyErr_SetString(PyExc_ValueError, "factored: factor sizes do not fit the tensor");
        goto done;
    }
    if (code == F16) { result = Py_None; Py_INCREF(result); goto done; } /* NumPy rounds */
    va = widen_all(a.buf, na, acode, &nan);
    vb = va ? widen_all(b.buf, nb, bcode, &nan) : NULL;
    if (vb == NULL) goto done;
    if (nan) { result = Py_None; Py_INCREF(result); goto done; }
    result = PyBytes_FromStringAndSize(NULL, prev.len);
    if (result == NULL) goto done;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    const unsigned char *pp = prev.buf;
    int by_row = na == rows;
    double *change = rank ? PyMem_RawMalloc((size_t)(cols ? cols : 1) * sizeof(double)) : NULL;
    if (rank && change == NULL) {
        Py_CLEAR(result);
        PyErr_NoMemory();
        goto done;
    }
    change_row_fn row = change_row();
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < rows && !nan; i++) {
        if (rank) row(change, va + i * rank, vb, rank, cols);
        for (Py_ssize_t j = 0; j < cols; j++) {
            double base = load_double(pp, i * cols + j, code);
            if (isnan(base)) { nan = 1; break; }
            double v = rank ? base + scale * change[j] : base * va[by_row ? i : j];
            store_rounded(out, i * cols + j, v, code);
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(change);
    if (nan) {
        Py_DECREF(result);
        result = Py_None;
        Py_INCREF(result);
    }
done:
    PyMem_RawFree(va);
    PyMem_RawFree(vb);
    PyBuffer_Release(&prev);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return result;
}


/* factored_steps(prev, code, rows, cols, a, acode, b, bcode, rank, scale) -> bytes or None.
 * Low-rank with rounding "steps" (factored.py ROUNDINGS, `_combine`), for F32 and BF16
 * tensors whose factors are at most 32 bits wide: per element, acc = fmaf(R[i,k],
 * C[k,j], acc) from +0.0 for each rank k (a float32 fused multiply-add: the one
 * rounding NumPy's `_round32` gives the float64 product plus acc), delta = float32 of
 * acc * float32(scale) (an exact double product, rounded once), narrowed to BF16 when
 * the tensor and both factors are BF16, then float32 of value + delta (one rounding,
 * fmaf with 1.0), rounded to the tensor's dtype. Any non-finite input, step or result
 * returns None: NumPy then decides (it owns what overflow and NaN payloads give). */
static inline float narrow_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits = ((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16) << 16; /* RNE, as _to_dtype */
    memcpy(&v, &bits, 4);
    return v;
}

static PyObject *factored_steps(PyObject *self, PyObject *args) {
    Py_buffer prev, a, b;
    int code, acode, bcode;
    Py_ssize_t rows, cols, rank;
    double scale;
    if (!PyArg_ParseTuple(args, "y*inny*iy*ind", &prev, &code, &rows, &cols, &a, &acode, &b,
                          &bcode, &rank, &scale))
        return NULL;
    PyObject *result = NULL;
    float *va = NULL, *vb = NULL;
    int bad = 0;
    if ((code != F32 && code != BF16) || (acode != F32 && acode != BF16 && acode != F16) ||
        (bcode != F32 && bcode != BF16 && bcode != F16) || rows <= 0 || cols <= 0 ||
        rank <= 0 || rank > a.len || rows > prev.len || cols > prev.len / rows ||
        prev.len != rows * cols * float_size(code) || a.len % float_size(acode) ||
        b.len % float_size(bcode) || a.len / float_size(acode) / rank != rows ||
        (a.len / float_size(acode)) % rank || b.len / float_size(bcode) / rank != cols ||
        (b.len / float_size(bcode)) % rank) {
        PyErr_SetString(PyExc_ValueError, "factored_steps: bad dtype codes or sizes");
        goto done;
    }
    float scale32 = (float)scale;
    if (!isfinite(scale32)) { result = Py_None; Py_INCREF(result); goto done; }
    Py_ssize_t na = rows * rank, nb = rank * cols;
    va = PyMem_RawMalloc((size_t)na * sizeof(float));
    vb = PyMem_RawMalloc((size_t)nb * sizeof(float));
    if (va == NULL || vb == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < na; i++) { /* F16, BF16 and F32 values are floats exactly */
        va[i] = (float)load_double(a.buf, i, acode);
        if (!isfinite(va[i])) bad = 1;
    }
    for (Py_ssize_t i = 0; i < nb; i++) {
        vb[i] = (float)load_double(b.buf, i, bcode);
        if (!isfinite(vb[i])) bad = 1;
    }
    if (bad) { result = Py_None; Py_INCREF(result); goto done; }
    result = PyBytes_FromStringAndSize(NULL, prev.len);
    if (result == NULL) goto done;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    const unsigned char *pp = prev.buf;
    int narrow = code == BF16 && acode == BF16 && bcode == BF16;
    float *accs = PyMem_RawMalloc((size_t)cols * sizeof(float));
    if (accs == NULL) {
        Py_CLEAR(result);
        PyErr_NoMemory();
        goto done;
    }
    steps_row_fn row = steps_row();
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < rows && !bad; i++) {
        row(accs, va + i * rank, vb, rank, cols);
        for (Py_ssize_t j = 0; j < cols; j++) {
            float acc = accs[j];
            float delta = (float)((double)acc * (double)scale32);
            if (narrow) delta = narrow_bf16(delta);
            float base = (float)load_double(pp, i * cols + j, code);
            float v = fmaf(delta, 1.0f, base);
            if (!isfinite(acc) || !isfinite(delta) || !isfinite(base) || !isfinite(v)) {
                bad = 1;
                break;
            }
            store_rounded(out, i * cols + j, v, code);
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(accs);
    if (bad) {
        Py_DECREF(result);
        result = Py_None;
        Py_INCREF(result);
    }
done:
    PyMem_RawFree(va);
    PyMem_RawFree(vb);
    PyBuffer_Release(&prev);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return result;
}


/* --- sparse changes: which elements differ, bit for bit --------------------------- */

static Py_ssize_t count_changed_n(const unsigned char *a, const unsigned char *b,
                                  Py_ssize_t n, Py_ssize_t size) {
    Py_ssize_t changed = 0;
#define COUNT_FIXED(T)                                                                  \
    for (Py_ssize_t i = 0; i < n; i++) {                                                \
        T x, y;                                                                         \
        memcpy(&x, a + i * sizeof(T), sizeof(T));                                       \
        memcpy(&y, b + i * sizeof(T), sizeof(T));                                       \
        changed += x != y;                                                              \
    }
    switch (size) {
    case 1: COUNT_FIXED(uint8_t) break;
    case 2: COUNT_FIXED(uint16_t) break;
    case 4: COUNT_FIXED(uint32_t) break;
    case 8: COUNT_FIXED(uint64_t) break;
    default:
        for (Py_ssize_t i = 0; i < n; i++) changed += memcmp(a + i * size, b + i * size, (size_t)size) != 0;
    }
#undef COUNT_FIXED
    return changed;
}

static int same_elements(Py_buffer *a, Py_buffer *b, Py_ssize_t size) {
    if (size < 1 || a->len != b->len || a->len % size) {
        PyErr_SetString(PyExc_ValueError, "values differ in length or are not whole elements");
        return 0;
    }
    return 1;
}

/* count_changed(old, new, size) -> how many elements' bytes differ. */
static PyObject *count_changed(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    Py_ssize_t size, changed = 0;
    if (!PyArg_ParseTuple(args, "y*y*n", &a, &b, &size)) return NULL;
    PyObject *result = NULL;
    if (same_elements(&a, &b, size)) {
        Py_BEGIN_ALLOW_THREADS
        changed = count_changed_n(a.buf, b.buf, a.len / size, size);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(changed);
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return result;
}

/* sparse_diff(old, new, size, start, stop, last) -> (gaps, values, last): for each element
 * of [start, stop) whose bytes differ, the distance from the previous such element (from
 * `last` for the first: 0 at the tensor's start, else what the previous range returned)
 * as u64 LE, and its new bytes; and the position of the range's last such element (`last`
 * when there is none). What sparse.py stores, without NumPy, one range at a time so that
 * the positions and values of a tensor's changed elements are never all held at once. */
static PyObject *sparse_diff(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    Py_ssize_t size, start, stop;
    unsigned long long last_in;
    if (!PyArg_ParseTuple(args, "y*y*nnnK", &a, &b, &size, &start, &stop, &last_in)) return NULL;
    PyObject *gaps = NULL, *values = NULL, *result = NULL;
    if (!same_elements(&a, &b, size)) goto done;
    Py_ssize_t n = a.len / size, changed;
    if (start < 0 || stop < start || stop > n ||
        (start == 0 ? last_in != 0 : last_in >= (unsigned long long)start)) {
        PyErr_SetString(PyExc_ValueError, "range is not within the elements, or last is not before it");
        goto done;
    }
    const unsigned char *pa = (const unsigned char *)a.buf + start * size;
    const unsigned char *pb = (const unsigned char *)b.buf + start * size;
    Py_ssize_t m = stop - start;
    Py_BEGIN_ALLOW_THREADS
    changed = count_changed_n(pa, pb, m, size);
    Py_END_ALLOW_THREADS
    gaps = PyBytes_FromStringAndSize(NULL, changed * 8);
    values = PyBytes_FromStringAndSize(NULL, changed * size);
    if (gaps == NULL || values == NULL) goto done;
    unsigned char *pg = (unsigned char *)PyBytes_AS_STRING(gaps);
    unsigned char *px = (unsigned char *)PyBytes_AS_STRING(values);
    uint64_t last = (uint64_t)last_in;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0, k = 0; i < m && k < changed; i++) {
        if (memcmp(pa + i * size, pb + i * size, (size_t)size) == 0) continue;
        uint64_t at = (uint64_t)(start + i);
        uint64_t gap = LE_8(at - last);
        memcpy(pg + k * 8, &gap, 8);
        memcpy(px + k * size, pb + i * size, (size_t)size);
        last = at;
        k++;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(OOK)", gaps, values, (unsigned long long)last);
done:
    Py_XDECREF(gaps);
    Py_XDECREF(values);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return result;
}


/* --- Huffman-only inflate ------------------------------------------------------------
 * The codec stores exponent-like planes as raw deflate made with Z_HUFFMAN_ONLY: dynamic
 * Huffman blocks of literals and end-of-block, no matches. zlib inflates those one symbol
 * per table lookup (~0.35 GB/s here). At ~2.7 bits per symbol, an 11-bit lookup holds
 * three or four whole codes, so this decoder's table gives up to four literals per lookup.
 * Anything else a valid deflate stream may hold (stored blocks, matches, damaged data)
 * returns None and the caller lets zlib decode it: this is a fast path, not a second
 * definition of the format. */

#ifndef LUT
#define LUT 10
#endif
#define LUT_SIZE (1u << LUT)
#define MAXBITS 15

typedef struct {
    const unsigned char *p, *end;
    uint64_t buf;
    unsigned n;  /* valid bits in buf */
    size_t over; /* zero bytes fed in past the end of the input */
} bits_t;

static inline void refill(bits_t *b) {
    if (b->end - b->p >= 8) {
        uint64_t v;
        memcpy(&v, b->p, 8);
        b->buf |= LE_8(v) << b->n;
        b->p += (63 - b->n) >> 3;
        b->n |= 56;
    } else {
        while (b->n <= 56) {
            uint64_t byte = 0;
            if (b->p < b->end) byte = *b->p++;
            else b->over++;
            b->buf |= byte << b->n;
            b->n += 8;
        }
    }
}

/* True once a bit past the end of the input was consumed (a truncated or damaged stream). */
static inline int overrun(const bits_t *b) { return b->over * 8 > b->n; }

static inline uint32_t take(bits_t *b, unsigned k) {
    if (b->n < k) refill(b);
    uint32_t v = (uint32_t)(b->buf & ((1u << k) - 1));
    b->buf >>= k;
    b->n -= k;
    return v;
}

typedef struct {
    uint16_t count[MAXBITS + 1]; /* codes of each length */
    uint16_t symbol[288];        /* symbols in canonical order */
    uint16_t single[LUT_SIZE];   /* (symbol << 4) | length for codes <= LUT bits, else 0 */
    int first, index;            /* huff_decode's walk after LUT bits of a longer code */
} huff_t;

/* Canonical code from lengths; 0 unless the code is complete (zlib rejects most
 * incomplete codes; any such stream goes to zlib, which decides). */
static int huff_build(huff_t *h, const unsigned char *lens, int n) {
    uint16_t offs[MAXBITS + 2];
    memset(h->count, 0, sizeof h->count);
    for (int s = 0; s < n; s++) h->count[lens[s]]++;
    h->count[0] = 0;
    int left = 1;
    for (int len = 1; len <= MAXBITS; len++) {
        left = (left << 1) - h->count[len];
        if (left < 0) return 0;
    }
    if (left != 0) return 0;
    offs[1] = 0;
    for (int len = 1; len <= MAXBITS; len++) offs[len + 1] = (uint16_t)(offs[len] + h->count[len]);
    for (int s = 0; s < n; s++)
        if (lens[s]) h->symbol[offs[lens[s]]++] = (uint16_t)s;
    memset(h->single, 0, sizeof h->single);
    /* Where huff_decode's walk stands after LUT bits that begin no code of <= LUT bits
     * (the same for every such prefix): it resumes there instead of at bit one. */
    int first = 0, index = 0;
    for (int len = 1; len <= LUT; len++) {
        index += h->count[len];
        first = (first + h->count[len]) << 1;
    }
    h->first = first;
    h->index = index;
    uint32_t code = 0;
    int k = 0;
    for (int len = 1; len <= LUT; len++) {
        for (int i = 0; i < h->count[len]; i++, k++, code++) {
            uint32_t rev = 0; /* deflate sends codes most significant bit first */
            for (int j = 0; j < len; j++) rev |= ((code >> j) & 1u) << (len - 1 - j);
            for (uint32_t x = rev; x < LUT_SIZE; x += 1u << len)
                h->single[x] = (uint16_t)((h->symbol[k] << 4) | len);
        }
        code <<= 1;
    }
    return 1;
}

/* One symbol, however long its code; -1 for a code no symbol has. */
static int huff_decode(const huff_t *h, bits_t *b) {
    if (b->n < MAXBITS) refill(b);
    uint16_t e = h->single[b->buf & (LUT_SIZE - 1)];
    if (e) {
        b->buf >>= e & 15;
        b->n -= e & 15;
        return e >> 4;
    }
    /* A code longer than LUT bits (the table has none of <= LUT starting so): its first
     * LUT bits, most significant first, then bit by bit on from the walk's state there. */
    uint32_t top = (uint32_t)(b->buf & (LUT_SIZE - 1)), rev = 0;
    for (int j = 0; j < LUT; j++) rev |= ((top >> j) & 1u) << (LUT - 1 - j);
    b->buf >>= LUT;
    b->n -= LUT;
    int code = (int)rev << 1, first = h->first, index = h->index;
    for (int len = LUT + 1; len <= MAXBITS; len++) {
        code |= (int)(b->buf & 1);
        b->buf >>= 1;
        b->n--;
        int count = h->count[len];
        if (code - count < first) return h->symbol[index + (code - first)];
        index += count;
        first = (first + count) << 1;
        code <<= 1;
    }
    return -1;
}

/* Up to six literals per LUT-bit lookup. Entry: bits used (low 6 bits, so it shifts the
 * buffer directly), count << 6, literals from bit 16 up, first in the lowest byte. */
static void multi_build(const huff_t *h, uint64_t *multi) {
    for (uint32_t i = 0; i < LUT_SIZE; i++) {
        uint64_t syms = 0;
        unsigned used = 0, count = 0;
        while (count < 6) {
            uint16_t e = h->single[(i >> used) & (LUT_SIZE - 1)];
            unsigned len = e & 15;
            if (!len || used + len > LUT || (e >> 4) > 255) break;
            syms |= (uint64_t)(e >> 4) << (8 * count);
            used += len;
            count++;
        }
        multi[i] = used | (count << 6) | (syms << 16);
    }
}

/* 1: the block's literals appended at *pos; 0: not a stream this decoder takes. */
static int inflate_block(bits_t *b, const huff_t *h, const uint64_t *multi,
                         unsigned char *out, size_t size, size_t *pos) {
    size_t at = *pos;
    for (;;) {
        /* The hot loop keeps the bit buffer in registers: through the struct, every
         * lookup waited on a store and a reload of it. */
        uint64_t buf = b->buf;
        unsigned nbits = b->n;
        const unsigned char *p = b->p;
        /* A refill every LOOKUPS lookups, without a branch: one tested against the bit
         * count mispredicted every few lookups, the loop's largest cost. After it at
         * least 56 bits are held, LOOKUPS codes' worth. */
        enum { LOOKUPS = 56 / LUT };
        while (at + 6 * LOOKUPS + 8 <= size && b->end - p >= 8) {
            uint64_t v;
            memcpy(&v, p, 8);
            buf |= LE_8(v) << nbits;
            p += (63 - nbits) >> 3;
            nbits |= 56;
            for (int k = 0; k < LOOKUPS; k++) {
                uint64_t e = multi[buf & (LUT_SIZE - 1)];
                unsigned count = (unsigned)(e >> 6) & 7;
                if (!count) goto slow;
                uint64_t syms = LE_8(e >> 16);
                memcpy(out + at, &syms, 8); /* writes eight (at + 8 <= size), keeps count */
                at += count;
                buf >>= e & 63;
                nbits -= (unsigned)(e & 63);
            }
        }
        while (at + 8 <= size) {
            if (nbits < LUT) {
                if (b->end - p < 8) break; /* the slow path refills near the end */
                uint64_t v;
                memcpy(&v, p, 8);
                buf |= LE_8(v) << nbits;
                p += (63 - nbits) >> 3;
                nbits |= 56;
            }
            uint64_t e = multi[buf & (LUT_SIZE - 1)];
            unsigned count = (unsigned)(e >> 6) & 7;
            if (!count) break;
            uint64_t syms = LE_8(e >> 16);
            memcpy(out + at, &syms, 8);
            at += count;
            buf >>= e & 63;
            nbits -= (unsigned)(e & 63);
        }
    slow:
        b->buf = buf;
        b->n = nbits;
        b->p = p;
        int sym = huff_decode(h, b);
        if (sym == 256) break;
        if (sym < 0 || sym > 255 || at >= size || overrun(b)) return 0;
        out[at++] = (unsigned char)sym;
    }
    *pos = at;
    return !overrun(b);
}

static const unsigned char cl_order[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};

static int inflate_literals_n(const unsigned char *in, size_t n, unsigned char *out, size_t size) {
    bits_t b = {in, in + n, 0, 0, 0};
    /* h: the literal code, aux: code-length and distance codes. zlib emits a new block
     * every 16-32K symbols, usually with the same literal code as the last: then the
     * tables are kept, since building them costs as much as decoding a third of a block. */
    huff_t *h = PyMem_RawMalloc(2 * sizeof(huff_t));
    uint64_t *multi = PyMem_RawMalloc(LUT_SIZE * sizeof(uint64_t));
    int ok = h != NULL && multi != NULL;
    huff_t *aux = h + 1;
    unsigned char lens[320], built[288];
    int built_n = 0; /* symbols in `built`, the lengths h and multi hold; 0: none */
    size_t pos = 0;
    int last = 0;
    while (ok && !last) {
        last = (int)take(&b, 1);
        unsigned type = take(&b, 2);
        unsigned hlit = 288;
        if (type == 1) { /* fixed code */
            memset(lens, 8, 144);
            memset(lens + 144, 9, 112);
            memset(lens + 256, 7, 24);
            memset(lens + 280, 8, 8);
        } else if (type == 2) {
            hlit = take(&b, 5) + 257;
            unsigned hdist = take(&b, 5) + 1, hclen = take(&b, 4) + 4;
            unsigned char cl[19] = {0};
            for (unsigned i = 0; i < hclen; i++) cl[cl_order[i]] = (unsigned char)take(&b, 3);
            ok = hlit <= 286 && hdist <= 30 && huff_build(aux, cl, 19);
            unsigned i = 0;
            while (ok && i < hlit + hdist) {
                int sym = huff_decode(aux, &b);
                unsigned rep = 1;
                unsigned char value = (unsigned char)sym;
                if (sym < 0 || overrun(&b)) ok = 0;
                else if (sym == 16) {
                    ok = i > 0;
                    value = ok ? lens[i - 1] : 0;
                    rep = 3 + take(&b, 2);
                } else if (sym == 17) {
                    value = 0;
                    rep = 3 + take(&b, 3);
                } else if (sym == 18) {
                    value = 0;
                    rep = 11 + take(&b, 7);
                }
                if (ok && i + rep > hlit + hdist) ok = 0;
                for (; ok && rep; rep--) lens[i++] = value;
            }
            /* The distance code goes unused but must be valid, as zlib requires. */
            ok = ok && lens[256] != 0 && huff_build(aux, lens + hlit, (int)hdist);
        } else {
            ok = 0; /* stored block or a reserved type: zlib's to handle */
        }
        if (ok && (built_n != (int)hlit || memcmp(built, lens, hlit) != 0)) {
            built_n = 0;
            ok = huff_build(h, lens, (int)hlit);
            if (ok) {
                multi_build(h, multi);
                memcpy(built, lens, hlit);
                built_n = (int)hlit;
            }
        }
        if (ok) ok = inflate_block(&b, h, multi, out, size, &pos);
    }
    PyMem_RawFree(h);
    PyMem_RawFree(multi);
    return ok && pos == size;
}

/* The bit loops of both Huffman coders shift by a count read from a table at every
 * code: BMI2's shrx/shlx take it in any register, in one cycle (a shift by %cl is
 * three micro-ops, in the chain from one lookup to the next). The same code built a
 * second time for CPUs that have it (flatten: everything it calls is compiled so),
 * chosen at run time; the bytes are the same either way. */
#if defined(__x86_64__) && defined(__GNUC__)
static int has_bmi2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("bmi2");
}
__attribute__((target("bmi2"), flatten)) static int inflate_literals_bmi2(
    const unsigned char *in, size_t n, unsigned char *out, size_t size) {
    return inflate_literals_n(in, n, out, size);
}
#define INFLATE_LITERALS(in, n, out, size) \
    (has_bmi2() ? inflate_literals_bmi2 : inflate_literals_n)(in, n, out, size)
#else
#define INFLATE_LITERALS inflate_literals_n
#endif

/* inflate_literals(payload, size) -> bytes of exactly size, or None (use zlib). */
static PyObject *inflate_literals(PyObject *self, PyObject *args) {
    Py_buffer in;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "y*n", &in, &size)) return NULL;
    PyObject *out = size >= 0 ? PyBytes_FromStringAndSize(NULL, size) : NULL;
    int ok = 0;
    if (out != NULL) {
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS
        ok = INFLATE_LITERALS(in.buf, (size_t)in.len, dst, (size_t)size);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&in);
    if (out == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "size must not be negative");
        return NULL;
    }
    if (!ok) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

/* Grouped planes (the codec's GROUPED flag): a delta's byte planes reordered so that the
 * elements whose previous value has the same top byte (after the rotation: a float's
 * exponent) are together. The size of a change in bit-pattern units follows the old
 * value's exponent, so each group's high planes are far more skewed than the whole
 * plane's, and the entropy coder's blocks adapt to them. The order is a stable counting
 * sort on that key, so the decoder rebuilds it from the previous value alone. */
static inline unsigned char group_key(const unsigned char *w, int word) {
    return (unsigned char)((w[word - 1] << 1) | (w[word - 2] >> 7));
}

/* Every word's key, read as whole words so the loop vectorises (3.5x the byte loop). */
#define KEYS_FIXED(NAME, T, WORD)                                                        \
    static void NAME(unsigned char *restrict keys, const unsigned char *restrict ctx,    \
                     Py_ssize_t n) {                                                     \
        for (Py_ssize_t i = 0; i < n; i++) {                                             \
            T w;                                                                         \
            memcpy(&w, ctx + i * (WORD), (WORD));                                        \
            keys[i] = (unsigned char)(LE_##WORD(w) >> ((WORD) * 8 - 9));                 \
        }                                                                                \
    }
KEYS_FIXED(keys2, uint16_t, 2)
KEYS_FIXED(keys4, uint32_t, 4)
KEYS_FIXED(keys8, uint64_t, 8)

static void group_keys(unsigned char *keys, const unsigned char *ctx, Py_ssize_t n, int word) {
    switch (word) {
    case 2: keys2(keys, ctx, n); break;
    case 4: keys4(keys, ctx, n); break;
    default: keys8(keys, ctx, n); break;
    }
}

/* Move byte i of `m` (1 to 3) planes to (forward) or from (back) its place in grouped
 * order, walking the keys once: `cur` is where each key's run starts, and advances. The
 * planes are named one by one so the compiler knows they do not overlap. */
#define MOVE_PLANES(NAME, BODY)                                                          \
    static void NAME(unsigned char *const *dst, const unsigned char *const *src, int m,  \
                     const unsigned char *restrict keys, Py_ssize_t n,                   \
                     const uint32_t *start) {                                            \
        uint32_t cur[256];                                                               \
        memcpy(cur, start, sizeof cur);                                                  \
        unsigned char *restrict d0 = dst[0];                                             \
        const unsigned char *restrict s0 = src[0];                                       \
        if (m == 1) {                                                                    \
            for (Py_ssize_t i = 0; i < n; i++) {                                         \
                uint32_t j = cur[keys[i]]++;                                             \
                BODY(d0, s0);                                                            \
            }                                                                            \
            return;                                                                      \
        }                                                                                \
        unsigned char *restrict d1 = dst[1];                                             \
        const unsigned char *restrict s1 = src[1];                                       \
        if (m == 2) {                                                                    \
            for (Py_ssize_t i = 0; i < n; i++) {                                         \
                uint32_t j = cur[keys[i]]++;                                             \
                BODY(d0, s0);                                                            \
                BODY(d1, s1);                                                            \
            }                                                                            \
            return;                                                                      \
        }                                                                                \
        unsigned char *restrict d2 = dst[2];                                             \
        const unsigned char *restrict s2 = src[2];                                       \
        for (Py_ssize_t i = 0; i < n; i++) {                                             \
            uint32_t j = cur[keys[i]]++;                                                 \
            BODY(d0, s0);                                                                \
            BODY(d1, s1);                                                                \
            BODY(d2, s2);                                                                \
        }                                                                                \
    }
#define MOVE_TO(D, S) ((D)[j] = (S)[i])
#define MOVE_BACK(D, S) ((D)[i] = (S)[j])
MOVE_PLANES(move_to, MOVE_TO)
MOVE_PLANES(move_back, MOVE_BACK)

/* Move every plane to (forward) or from its place in grouped order, three planes per
 * walk (planes in one walk share its cost, the larger part); 0 when out of memory. */
static int permute(unsigned char *const *dst, const unsigned char *const *src, int planes,
                   const unsigned char *ctx, Py_ssize_t n, int word, int forward) {
    unsigned char *keys = malloc((size_t)n + 1);
    if (keys == NULL) return 0;
    uint32_t count[4][256] = {{0}};
    group_keys(keys, ctx, n, word);
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {  /* four histograms: no wait on the previous increment */
        count[0][keys[i]]++;
        count[1][keys[i + 1]]++;
        count[2][keys[i + 2]]++;
        count[3][keys[i + 3]]++;
    }
    for (; i < n; i++) count[0][keys[i]]++;
    uint32_t start[256], at = 0;
    for (int k = 0; k < 256; k++) {
        start[k] = at;
        at += count[0][k] + count[1][k] + count[2][k] + count[3][k];
    }
    for (int p = 0; p < planes; p += 3) {
        int batch = planes - p < 3 ? planes - p : 3;
        (forward ? move_to : move_back)(dst + p, src + p, batch, keys, n, start);
    }
    free(keys);
    return 1;
}

/* Sum of c*log2(c) over the counts, in index order (the NumPy twin sums in the same
 * order: the same double on the same machine). */
static double c_log_c(const uint32_t *counts, int n, Py_ssize_t *nonzero) {
    double sum = 0.0;
    for (int s = 0; s < n; s++)
        if (counts[s]) {
            sum += counts[s] * log2((double)counts[s]);
            (*nonzero)++;
        }
    return sum;
}

/* group_gain(plane, context, word, step) -> float: on every step-th byte, how many bits
 * per byte the plane's order-0 entropy drops when each context key is coded on its own
 * (Miller-Madow corrected, so many small groups do not look like a gain). */
static PyObject *group_gain(PyObject *self, PyObject *args) {
    Py_buffer plane, context;
    int word;
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "y*y*in", &plane, &context, &word, &step)) return NULL;
    PyObject *result = NULL;
    uint32_t *counts = NULL;
    if (!check_word(word)) goto done;
    if (context.len != plane.len * word || step < 1) {
        PyErr_SetString(PyExc_ValueError, "context is not one word per plane byte, or step < 1");
        goto done;
    }
    /* A step past the plane samples its first byte only (as the NumPy twin's slice
     * does): clamped, so (len + step - 1) cannot overflow. */
    if (step > plane.len) step = plane.len > 0 ? plane.len : 1;
    const unsigned char *p = plane.buf, *ctx = context.buf;
    double gain = 0.0;
    Py_BEGIN_ALLOW_THREADS
    /* Rows only for the keys present (a chunk of weights has ~20 exponents): a 256 KB
     * table would cost more to clear than the sample costs to count. */
    uint32_t sizes[256] = {0};
    int row[256], groups = 0;
    Py_ssize_t total = (plane.len + step - 1) / step;
    unsigned char *keys = malloc((size_t)total + 1);  /* the sample's keys: read once */
    if (keys != NULL) {
        /* Counted in four tables, summed: most samples share a few keys, and one
         * table's counter waited on its own last increment. */
        uint32_t part[4][256] = {{0}};
        Py_ssize_t t = 0;
        for (; t + 4 <= total; t += 4) {
            /* The sample is one byte per cache line or more apart: ask for lines ahead. */
            if (t + 64 < total) __builtin_prefetch(ctx + (t + 64) * step * word);
            for (int k = 0; k < 4; k++)
                part[k][keys[t + k] = group_key(ctx + (t + k) * step * word, word)]++;
        }
        for (; t < total; t++) part[0][keys[t] = group_key(ctx + t * step * word, word)]++;
        for (int k = 0; k < 256; k++) sizes[k] = part[0][k] + part[1][k] + part[2][k] + part[3][k];
    }
    for (int k = 0; k < 256; k++) row[k] = sizes[k] ? groups++ : -1;
    /* Two tables of counts, one per half of the sample, summed into the first: where a
     * plane is mostly one byte, one table's counter was a chain of increments. */
    size_t cells = (size_t)(groups ? groups : 1) * 256;
    counts = keys == NULL ? NULL : calloc(2 * cells, sizeof *counts);
    if (counts != NULL && total) {
        uint32_t *second = counts + cells;
        Py_ssize_t half = total / 2;
        for (Py_ssize_t t = 0; t < half; t++) {
            counts[row[keys[t]] * 256 + p[t * step]]++;
            second[row[keys[t + half]] * 256 + p[(t + half) * step]]++;
        }
        for (Py_ssize_t t = 2 * half; t < total; t++) counts[row[keys[t]] * 256 + p[t * step]]++;
        for (size_t c = 0; c < cells; c++) counts[c] += second[c];
        uint32_t marginal[256] = {0};
        Py_ssize_t m0 = 0, mk = 0, present = 0;
        double within = 0.0;
        for (int g = 0; g < groups; g++) {
            for (int b = 0; b < 256; b++) marginal[b] += counts[g * 256 + b];
            within += c_log_c(counts + g * 256, 256, &mk);
        }
        double across = c_log_c(sizes, 256, &present);
        double whole = c_log_c(marginal, 256, &m0);
        double n = (double)total;
        /* n*H0 = n log n - whole; n*Hc = across - within. */
        double drop = (n * log2(n) - whole - (across - within)) / n;
        gain = drop + ((double)(m0 - 1) - (double)(mk - present)) / (2.0 * n * log(2.0));
    }
    free(keys);
    Py_END_ALLOW_THREADS
    if (counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyFloat_FromDouble(gain);
done:
    free(counts);
    PyBuffer_Release(&plane);
    PyBuffer_Release(&context);
    return result;
}

/* group(planes, context, word, forward) -> list of bytes: each plane (one byte per word
 * of `context`) in grouped order (forward) or back from it. */
static PyObject *group(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_buffer context;
    int word, forward;
    if (!PyArg_ParseTuple(args, "Oy*ip", &seq, &context, &word, &forward)) return NULL;
    Py_buffer in[PLANES_MAX];
    int held = 0;
    PyObject *list = NULL, *result = NULL;
    if (!check_word(word) || context.len % word) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "context is not whole words");
        goto done;
    }
    Py_ssize_t n = context.len / word, count = PySequence_Check(seq) ? PySequence_Size(seq) : -1;
    if (count < 0 || count > PLANES_MAX) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "need a sequence of at most 8 planes");
        goto done;
    }
    if (n > (Py_ssize_t)UINT32_MAX) {  /* the order is held in 32 bits (a chunk is 1 Mi words) */
        PyErr_SetString(PyExc_ValueError, "more than 2**32 - 1 words");
        goto done;
    }
    const unsigned char *src[PLANES_MAX];
    unsigned char *dst[PLANES_MAX];
    list = PyList_New(count);
    if (list == NULL) goto done;
    for (; held < count; held++) {
        PyObject *item = PySequence_GetItem(seq, held);
        if (item == NULL) goto done;
        int rc = PyObject_GetBuffer(item, &in[held], PyBUF_SIMPLE);
        Py_DECREF(item);
        if (rc < 0) goto done;
        if (in[held].len != n) {
            held++;
            PyErr_SetString(PyExc_ValueError, "plane length does not match the context");
            goto done;
        }
        src[held] = in[held].buf;
        PyObject *plane = PyBytes_FromStringAndSize(NULL, n);
        if (plane == NULL) {
            held++;
            goto done;
        }
        dst[held] = (unsigned char *)PyBytes_AS_STRING(plane);
        PyList_SET_ITEM(list, held, plane);
    }
    const unsigned char *ctx = context.buf;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    if (count) ok = permute(dst, src, (int)count, ctx, n, word, forward);
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_NoMemory();
        goto done;
    }
    result = list;
    list = NULL;
done:
    Py_XDECREF(list);
    for (int k = 0; k < held; k++) PyBuffer_Release(&in[k]);
    PyBuffer_Release(&context);
    return result;
}

/* The codec's Huffman planes, written: a raw deflate stream (RFC 1951) of dynamic-Huffman
 * blocks of literals only, the kind Z_HUFFMAN_ONLY writes and inflate_literals reads.
 * zlib-ng coded ~85 MB/s (per-symbol block bookkeeping, a tree per 32 K symbols); here
 * one table lookup and shift per byte. Each block of `block` input bytes gets the
 * Huffman code of its own histogram (so the code follows the plane), its end-of-block
 * symbol, and two one-bit distance codes (unused, but inflaters want a complete code).
 * codec.py has the same encoder in NumPy (_deflate_numpy); the tests check the two
 * write the same bytes. */

#define LIT_SYMS 257 /* 256 literals and end-of-block */
#define CL_SYMS 19

/* A leaf's sort key: frequency above, symbol in the low 9 bits, so ascending keys are
 * ascending (frequency, symbol), the one order the NumPy definition sorts by. */
#define SYM_BITS 9

/* Sort keys[0..m) ascending: insertion for a few, else least-significant-byte radix
 * passes over the bytes the largest key has (qsort's calls cost a tenth of a block). */
static void sort_keys(uint64_t *keys, int m) {
    if (m <= 24) {
        for (int i = 1; i < m; i++) {
            uint64_t k = keys[i];
            int j = i;
            for (; j > 0 && keys[j - 1] > k; j--) keys[j] = keys[j - 1];
            keys[j] = k;
        }
        return;
    }
    uint64_t tmp[LIT_SYMS], top = 0, *from = keys, *to = tmp;
    for (int i = 0; i < m; i++) top |= keys[i];
    for (unsigned shift = 0; shift < 64 && (top >> shift); shift += 8) {
        int start[256] = {0};
        for (int i = 0; i < m; i++) start[(from[i] >> shift) & 255]++;
        for (int b = 0, at = 0; b < 256; b++) {
            int c = start[b];
            start[b] = at;
            at += c;
        }
        for (int i = 0; i < m; i++) to[start[(from[i] >> shift) & 255]++] = from[i];
        uint64_t *t = from;
        from = to;
        to = t;
    }
    if (from != keys) memcpy(keys, from, (size_t)m * sizeof *keys);
}

/* Code lengths of at most `limit` bits for symbols 0..n-1 (n <= LIT_SYMS) with
 * frequencies `freq` (0: no code). Huffman's lengths; where one passes the limit, the
 * long codes are cut to it and the Kraft sum restored by lengthening the codes nearest
 * it, one unit at a time. A lone symbol gets a partner (0, or 1 when it is 0), so the
 * code is complete: inflate_literals and zlib both require that. */
static void code_lengths(const uint64_t *freq, int n, int limit, unsigned char *lens) {
    uint64_t leaves[LIT_SYMS];
    uint64_t weight[2 * LIT_SYMS];
    int parent[2 * LIT_SYMS], depth[2 * LIT_SYMS], count[2 * LIT_SYMS] = {0};
    int m = 0;
    memset(lens, 0, (size_t)n);
    for (int s = 0; s < n; s++)
        if (freq[s]) leaves[m++] = freq[s] << SYM_BITS | (uint64_t)s;
    if (m < 2) {
        int only = m ? (int)(leaves[0] & ((1u << SYM_BITS) - 1)) : 0;
        lens[only] = 1;
        lens[only == 0 ? 1 : 0] = 1;
        return;
    }
    sort_keys(leaves, m);
    for (int i = 0; i < m; i++) weight[i] = leaves[i] >> SYM_BITS;
    /* Two queues, both ascending: the sorted leaves, and the nodes in the order made. */
    int leaf = 0, node = m;
    for (int next = m; next < 2 * m - 1; next++) {
        for (int k = 0; k < 2; k++) {
            int pick = (leaf < m && (node >= next || weight[leaf] <= weight[node])) ? leaf++ : node++;
            parent[pick] = next;
            weight[next] = k ? weight[next] + weight[pick] : weight[pick];
        }
    }
    depth[2 * m - 2] = 0;
    int longest = 0;
    for (int k = 2 * m - 3; k >= 0; k--) depth[k] = depth[parent[k]] + 1;
    for (int i = 0; i < m; i++) {
        count[depth[i]]++;
        if (depth[i] > longest) longest = depth[i];
    }
    if (longest > limit) {
        for (int d = limit + 1; d <= longest; d++) {
            count[limit] += count[d];
            count[d] = 0;
        }
        uint64_t kraft = 0; /* in units of 2**-limit */
        for (int d = 1; d <= limit; d++) kraft += (uint64_t)count[d] << (limit - d);
        while (kraft > (1ull << limit)) {
            /* One code at the limit goes; a shorter code splits into two one bit longer:
             * as many codes, one unit less. */
            count[limit]--;
            for (int d = limit - 1; d > 0; d--) {
                if (count[d]) {
                    count[d]--;
                    count[d + 1] += 2;
                    break;
                }
            }
            kraft--;
        }
        longest = limit;
    }
    /* The longest codes to the rarest symbols (leaves are in ascending frequency). */
    int i = 0;
    for (int d = longest; d >= 1; d--)
        for (int c = 0; c < count[d]; c++) lens[leaves[i++] & ((1u << SYM_BITS) - 1)] = (unsigned char)d;
}

/* Canonical codes for `lens`, bit-reversed (deflate sends a code's top bit first). */
static void canonical_codes(const unsigned char *lens, int n, uint32_t *codes) {
    uint32_t count[MAXBITS + 1] = {0}, next[MAXBITS + 2];
    for (int s = 0; s < n; s++) count[lens[s]]++;
    count[0] = 0;
    uint32_t code = 0;
    for (int len = 1; len <= MAXBITS; len++) {
        code = (code + count[len - 1]) << 1;
        next[len] = code;
    }
    for (int s = 0; s < n; s++) {
        unsigned len = lens[s];
        uint32_t c = len ? next[len]++ : 0, rev = 0;
        for (unsigned j = 0; j < len; j++) rev |= ((c >> j) & 1u) << (len - 1 - j);
        codes[s] = rev;
    }
}

typedef struct {
    unsigned char *p;
    uint64_t buf;
    unsigned n; /* bits in buf, at most 7 after a flush */
} bw_t;

/* Append the low k bits of v (k + n <= 64 before the next flush). */
static inline void bw_put(bw_t *w, uint64_t v, unsigned k) {
    w->buf |= v << w->n;
    w->n += k;
}

/* Write the whole bytes of the buffer (the output has 8 bytes of room past them). */
static inline void bw_flush(bw_t *w) {
    uint64_t v = LE_8(w->buf);
    memcpy(w->p, &v, 8);
    w->p += w->n >> 3;
    w->buf = (w->n & ~7u) ? w->buf >> (w->n & ~7u) : w->buf;
    w->n &= 7;
}

/* Run-length code of the code lengths (RFC 1951 3.2.7): symbols 0-15, 16 = the previous
 * length 3-6 times, 17 = 3-10 zeros, 18 = 11-138 zeros; `extra` holds each one's extra
 * bits. The literal and distance lengths are coded separately, as zlib codes them. */
static int rle_lengths(const unsigned char *lens, int n, unsigned char *sym, unsigned char *extra) {
    int out = 0;
    for (int i = 0; i < n;) {
        int run = 1;
        while (i + run < n && lens[i + run] == lens[i]) run++;
        if (lens[i] == 0 && run >= 3) {
            int take = run > 138 ? 138 : run;
            sym[out] = take >= 11 ? 18 : 17;
            extra[out++] = (unsigned char)(take >= 11 ? take - 11 : take - 3);
            i += take;
        } else if (lens[i] != 0 && run >= 4) {
            sym[out] = lens[i];
            extra[out++] = 0;
            int rest = run - 1;
            while (rest >= 3) {
                int take = rest > 6 ? 6 : rest;
                sym[out] = 16;
                extra[out++] = (unsigned char)(take - 3);
                rest -= take;
            }
            i += run - rest;
        } else {
            sym[out] = lens[i];
            extra[out++] = 0;
            i++;
        }
    }
    return out;
}

static const unsigned char cl_extra_bits[CL_SYMS] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 3, 7};

/* One block: header, the literals of data[0..len), end-of-block; 0 once the output
 * passed `stop`. */
static int deflate_block(bw_t *w, const unsigned char *data, size_t len, int last,
                         const unsigned char *stop) {
    /* Four histograms, summed: an exponent plane repeats a few bytes, and one table's
     * counter would wait on its own last increment at almost every byte. */
    uint32_t part[4][256] = {{0}};
    size_t i = 0;
    for (; i + 4 <= len; i += 4) {
        part[0][data[i]]++;
        part[1][data[i + 1]]++;
        part[2][data[i + 2]]++;
        part[3][data[i + 3]]++;
    }
    for (; i < len; i++) part[0][data[i]]++;
    uint64_t freq[LIT_SYMS];
    for (int s = 0; s < 256; s++)
        freq[s] = (uint64_t)part[0][s] + part[1][s] + part[2][s] + part[3][s];
    freq[256] = 1;
    unsigned char lens[LIT_SYMS + 2];
    uint32_t codes[LIT_SYMS];
    code_lengths(freq, LIT_SYMS, MAXBITS, lens);
    canonical_codes(lens, LIT_SYMS, codes);
    lens[LIT_SYMS] = lens[LIT_SYMS + 1] = 1; /* the two distance codes */
    unsigned char sym[LIT_SYMS + 2], extra[LIT_SYMS + 2];
    int nsym = rle_lengths(lens, LIT_SYMS, sym, extra);
    nsym += rle_lengths(lens + LIT_SYMS, 2, sym + nsym, extra + nsym);
    uint64_t cl_freq[CL_SYMS] = {0};
    for (int k = 0; k < nsym; k++) cl_freq[sym[k]]++;
    unsigned char cl_lens[CL_SYMS];
    uint32_t cl_codes[CL_SYMS];
    code_lengths(cl_freq, CL_SYMS, 7, cl_lens);
    canonical_codes(cl_lens, CL_SYMS, cl_codes);
    int hclen = CL_SYMS;
    while (hclen > 4 && cl_lens[cl_order[hclen - 1]] == 0) hclen--;
    bw_put(w, (uint64_t)(last ? 1 : 0) | (2u << 1), 3); /* BFINAL, BTYPE = dynamic */
    bw_put(w, 0, 5);                                     /* HLIT: 257 codes */
    bw_put(w, 1, 5);                                     /* HDIST: 2 codes */
    bw_put(w, (uint64_t)(hclen - 4), 4);
    bw_flush(w);
    for (int k = 0; k < hclen; k++) {
        bw_put(w, cl_lens[cl_order[k]], 3);
        bw_flush(w);
    }
    for (int k = 0; k < nsym; k++) {
        bw_put(w, cl_codes[sym[k]], cl_lens[sym[k]]);
        bw_put(w, extra[k], cl_extra_bits[sym[k]]);
        bw_flush(w);
    }
    /* A code and its length in one word: code in the low 16 bits, length above. */
    uint32_t table[256];
    unsigned longest = 0;
    for (int s = 0; s < 256; s++) {
        table[s] = codes[s] | ((uint32_t)lens[s] << 16);
        if (freq[s] && lens[s] > longest) longest = lens[s];
    }
    /* The writer in locals: through the struct, each group's store and reload of the
     * buffer was the loop's longest chain. At most 7 bits are left after a flush, so a
     * flush may follow 3 codes of <= 15 bits (45 + 7 <= 64) or, when the block's
     * longest code is at most 9 bits, 6 of them (54 + 7). */
    uint64_t buf = w->buf;
    unsigned nbits = w->n;
    unsigned char *out = w->p;
#define PUT3(AT)                                                                           \
    do {                                                                                   \
        uint64_t a_ = table[data[AT]], b_ = table[data[(AT) + 1]], c_ = table[data[(AT) + 2]]; \
        unsigned la_ = (unsigned)(a_ >> 16), lb_ = (unsigned)(b_ >> 16);                   \
        bits3 = (a_ & 0xFFFF) | ((b_ & 0xFFFF) << la_) | ((c_ & 0xFFFF) << (la_ + lb_));    \
        len3 = la_ + lb_ + (unsigned)(c_ >> 16);                                           \
    } while (0)
#define FLUSH()                                                                            \
    do {                                                                                   \
        uint64_t v_ = LE_8(buf);                                                           \
        memcpy(out, &v_, 8);                                                               \
        out += nbits >> 3;                                                                 \
        buf >>= nbits & 56u;                                                               \
        nbits &= 7u;                                                                       \
    } while (0)
    for (size_t at = 0; at < len;) {
        /* In pieces of 16 KiB, each followed by a check against `stop`: the output may
         * pass it by at most one piece (15 bits a byte) before the encoder gives up. */
        size_t end = len - at > 16384 ? at + 16384 : len;
        i = at;
        uint64_t bits3;
        unsigned len3;
        if (longest <= 9) {
            for (; i + 6 <= end; i += 6) {
                PUT3(i);
                uint64_t first = bits3;
                unsigned first_len = len3;
                PUT3(i + 3);
                buf |= (first | (bits3 << first_len)) << nbits;
                nbits += first_len + len3;
                FLUSH();
            }
        }
        for (; i + 3 <= end; i += 3) {
            PUT3(i);
            buf |= bits3 << nbits;
            nbits += len3;
            FLUSH();
        }
        for (; i < end; i++) {
            uint32_t a = table[data[i]];
            buf |= (uint64_t)(a & 0xFFFF) << nbits;
            nbits += a >> 16;
            FLUSH();
        }
        if (out > stop) {
            w->p = out;
            return 0;
        }
        at = end;
    }
#undef PUT3
#undef FLUSH
    w->buf = buf;
    w->n = nbits;
    w->p = out;
    bw_put(w, codes[256], lens[256]);
    bw_flush(w);
    return w->p <= stop;
}

/* The stream for data[0..n) into out, which has room for n + DEFLATE_SLACK bytes; its
 * length, or -1 once it is longer than n (the plane is kept raw then: no point going on).
 * Past n, the output grows by at most a block header (< 600 bytes) or one 16 KiB piece
 * (at 15 bits a byte, 30 KiB) before a check stops it. */
#define DEFLATE_SLACK ((size_t)1 << 16)
static Py_ssize_t deflate_literals_n(const unsigned char *data, size_t n, size_t block,
                                     unsigned char *out) {
    bw_t w = {out, 0, 0};
    const unsigned char *stop = out + n;
    size_t at = 0;
    do {
        size_t len = n - at < block ? n - at : block;
        if (!deflate_block(&w, data + at, len, at + len == n, stop)) return -1;
        at += len;
    } while (at < n);
    if (w.n) *w.p++ = (unsigned char)w.buf;
    return w.p > stop ? -1 : w.p - out;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("bmi2"), flatten)) static Py_ssize_t deflate_literals_bmi2(
    const unsigned char *data, size_t n, size_t block, unsigned char *out) {
    return deflate_literals_n(data, n, block, out);
}
#define DEFLATE_LITERALS(data, n, block, out) \
    (has_bmi2() ? deflate_literals_bmi2 : deflate_literals_n)(data, n, block, out)
#else
#define DEFLATE_LITERALS deflate_literals_n
#endif

/* deflate_literals(data, block) -> the stream as bytes, or None when it is longer than
 * data (the caller keeps such a plane raw). */
static PyObject *deflate_literals(PyObject *self, PyObject *args) {
    Py_buffer in;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "y*n", &in, &block)) return NULL;
    if (block < 1) {
        PyBuffer_Release(&in);
        PyErr_SetString(PyExc_ValueError, "block must be at least 1 byte");
        return NULL;
    }
    size_t n = (size_t)in.len;
    unsigned char *out = PyMem_RawMalloc(n + DEFLATE_SLACK);
    if (out == NULL) {
        PyBuffer_Release(&in);
        return PyErr_NoMemory();
    }
    Py_ssize_t got;
    Py_BEGIN_ALLOW_THREADS
    got = DEFLATE_LITERALS(in.buf, n, (size_t)block, out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&in);
    PyObject *result = got < 0 ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize((char *)out, got);
    PyMem_RawFree(out);
    return result;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS, "split(data, word, rotate) -> planes, most significant byte first"},
    {"join", join, METH_VARARGS, "join(out, planes, word, rotate): inverse of split, into out"},
    {"histogram", histogram, METH_VARARGS, "histogram(data, step) -> 256 byte counts of a sample"},
    {"entropy_bits", entropy_bits, METH_VARARGS, "entropy_bits(data, step) -> order-0 entropy of a sample, as codec._entropy_bits, or None"},
    {"scatter", scatter, METH_VARARGS, "scatter(value, gaps, values, size): sparse update in place"},
    {"diff_stats", diff_stats, METH_VARARGS, "diff_stats(old, new, kind) -> (changed, d2, max, x2)"},
    {"empty", empty, METH_VARARGS, "empty(n) -> bytearray of n uninitialised bytes"},
    {"prefault", prefault, METH_VARARGS, "prefault(buffer, start, end) -> whether the pages of buffer[start:end] were made present"},
    {"read_packets", read_packets, METH_VARARGS, "read_packets(fd, out, left) -> (filled, left, ended): pkt-line content into out"},
    {"keep_freed_memory", keep_freed_memory, METH_NOARGS, "keep_freed_memory() -> whether malloc now keeps and reuses freed memory"},
    {"zigzag", zigzag, METH_VARARGS, "zigzag(new, old, word) -> folded wrapping differences"},
    {"unzigzag_add", unzigzag_add, METH_VARARGS, "unzigzag_add(value, z, word): value += unfold(z)"},
    {"count_changed", count_changed, METH_VARARGS, "count_changed(old, new, size) -> elements whose bytes differ"},
    {"sparse_diff", sparse_diff, METH_VARARGS, "sparse_diff(old, new, size, start, stop, last) -> (u64 gaps, new bytes, last) of changed elements in a range"},
    {"deflate_literals", deflate_literals, METH_VARARGS, "deflate_literals(data, block) -> raw deflate of Huffman-coded literals, or None when longer than data"},
    {"inflate_literals", inflate_literals, METH_VARARGS, "inflate_literals(payload, size) -> bytes, or None when zlib must decode it"},
    {"factored", factored, METH_VARARGS, "factored(prev, code, rows, cols, a, acode, b, bcode, rank, scale) -> bytes or None"},
    {"factored_steps", factored_steps, METH_VARARGS, "factored_steps(prev, code, rows, cols, a, acode, b, bcode, rank, scale) -> bytes or None"},
    {"group_gain", group_gain, METH_VARARGS, "group_gain(plane, context, word, step) -> bits per byte grouping saves (estimate)"},
    {"group", group, METH_VARARGS, "group(planes, context, word, forward) -> planes in (or back from) the context's key order"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_planes", NULL, -1, methods};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&module); }
