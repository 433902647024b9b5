/* Byte-plane split and join for the codec, in one pass over the data.
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
#include <stdint.h>
#include <string.h>

#define PLANES_MAX 8

static inline uint64_t load_le(const unsigned char *p, int word) {
    uint64_t w = 0;
    for (int k = word - 1; k >= 0; k--) w = (w << 8) | p[k];
    return w;
}

static inline void store_le(unsigned char *p, uint64_t w, int word) {
    for (int k = 0; k < word; k++) {
        p[k] = (unsigned char)w;
        w >>= 8;
    }
}

/* Specialised per word size so the compiler unrolls the byte loops. */
#define SPLIT_LOOP(WORD)                                                                \
    for (Py_ssize_t i = 0; i < n; i++) {                                                \
        uint64_t w = load_le(src + i * (WORD), (WORD));                                 \
        if (rotate) w = ((w << 1) | (w >> ((WORD) * 8 - 1))) & mask;                    \
        for (int k = 0; k < (WORD); k++) dst[k][i] = (unsigned char)(w >> (8 * ((WORD) - 1 - k))); \
    }

#define JOIN_LOOP(WORD)                                                                 \
    for (Py_ssize_t i = 0; i < n; i++) {                                                \
        uint64_t w = 0;                                                                 \
        for (int k = 0; k < (WORD); k++) w = (w << 8) | src[k][i];                      \
        if (rotate) w = ((w >> 1) | (w << ((WORD) * 8 - 1))) & mask;                    \
        store_le(dst + i * (WORD), w, (WORD));                                          \
    }

static uint64_t word_mask(int word) { return word == 8 ? ~(uint64_t)0 : (((uint64_t)1 << (word * 8)) - 1); }

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
    uint64_t mask = word_mask(word);
    Py_BEGIN_ALLOW_THREADS
    switch (word) {
    case 2: SPLIT_LOOP(2) break;
    case 4: SPLIT_LOOP(4) break;
    default: SPLIT_LOOP(8) break;
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
    uint64_t mask = word_mask(word);
    Py_BEGIN_ALLOW_THREADS
    switch (word) {
    case 2: JOIN_LOOP(2) break;
    case 4: JOIN_LOOP(4) break;
    default: JOIN_LOOP(8) break;
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (int k = 0; k < held; k++) PyBuffer_Release(&planes[k]);
    PyBuffer_Release(&out);
    return result;
}

/* histogram(data, step) -> list of 256 counts of every step-th byte. */
static PyObject *histogram(PyObject *self, PyObject *args) {
    Py_buffer in;
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "y*n", &in, &step)) return NULL;
    if (step < 1) {
        PyBuffer_Release(&in);
        PyErr_SetString(PyExc_ValueError, "step must be at least 1");
        return NULL;
    }
    Py_ssize_t counts[256] = {0};
    const unsigned char *p = in.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < in.len; i += step) counts[p[i]]++;
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

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS, "split(data, word, rotate) -> planes, most significant byte first"},
    {"join", join, METH_VARARGS, "join(out, planes, word, rotate): inverse of split, into out"},
    {"histogram", histogram, METH_VARARGS, "histogram(data, step) -> 256 byte counts of a sample"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_planes", NULL, -1, methods};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&module); }
