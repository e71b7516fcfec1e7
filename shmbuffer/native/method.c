/* ReplayBuffer.push as a method whose usual calls run in C.
 *
 * PushMethod(func) stands for ReplayBuffer.push on the class (buffer.py); read from the class
 * it is func. Each buffer holds a BoundPush in its own __dict__ (PushMethod.seat, from
 * protocol/push.py's NativePush.seat as ReplayBuffer._setup lays the buffer out): func bound to the buffer, as a bound method is, whose
 * usual calls are push_from_args (push.c) when the buffer has a push plan (a uniform buffer
 * the one call serves), and every other call func(buffer, ...). So `buf.push` is a plain
 * instance attribute: CPython's specialised read, with no descriptor call and nothing made per
 * read (a `buf.push(**row)` reads it once a call).
 *
 * That BoundPush is resident: it refers to its buffer by a weak reference, since a strong one
 * from the buffer's own __dict__ would be a cycle, and the buffer would outlive `del buf` (its
 * block unlinked only by the cycle collector). When it leaves the __dict__ (PushMethod.unseat:
 * close(), a new plan, the buffer's __del__) while held elsewhere, it takes a strong reference:
 * a push read from a buffer keeps that buffer alive as a bound method does (at __del__ the
 * buffer is resurrected, PEP 442, until the push is dropped). A buffer without a seated push
 * (closed, or whose class overrides push) reads func bound as usual. */
#include "native.h"

#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *func;
} PushMethod;

typedef struct {
    PyObject_HEAD
    PyObject *plan; /* the buffer's push plan, or NULL: every call is func's */
    PyObject *self; /* the buffer once the push keeps it (unseat), else NULL */
    PyObject *ref;  /* until then, a weak reference to it */
    PyObject *func;
    vectorcallfunc vectorcall;
} BoundPush;

/* the buffer (borrowed), or NULL with an error when it is gone: found by the cycle collector,
 * or the push taken out of its __dict__ by hand, so that unseat never gave it the buffer */
static PyObject *bound_self(BoundPush *b) {
    PyObject *obj = b->self ? b->self : PyWeakref_GetObject(b->ref);
    if (obj == Py_None) PyErr_SetString(PyExc_ReferenceError, "push: its buffer was dropped");
    return obj == Py_None ? NULL : obj;
}

static PyObject *bound_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    BoundPush *b = (BoundPush *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *self = bound_self(b);
    if (!self) return NULL;
    if (b->plan) {
        PushPlan *p = plan_of(b->plan);
        PyObject *ids = p ? push_from_args(p, args, nargs, kwnames) : NULL;
        if (ids != Py_None) return ids; /* the ids, or NULL with an error */
        Py_DECREF(ids);
    }
    Py_INCREF(self); /* through the method's call, whatever it drops */
    PyObject *got;
    if (nargsf & PY_VECTORCALL_ARGUMENTS_OFFSET) { /* func(self, *args) in the slot before args, as a bound method calls */
        PyObject **with = (PyObject **)args - 1, *was = with[0];
        with[0] = self;
        got = PyObject_Vectorcall(b->func, with, (size_t)nargs + 1, kwnames);
        with[0] = was;
    } else {
        PyObject *method = PyMethod_New(b->func, self);
        got = method ? PyObject_Vectorcall(method, args, (size_t)nargs, kwnames) : NULL;
        Py_XDECREF(method);
    }
    Py_DECREF(self);
    return got;
}

static int bound_traverse(BoundPush *b, visitproc visit, void *arg) {
    Py_VISIT(b->plan);
    Py_VISIT(b->self);
    Py_VISIT(b->func);
    Py_VISIT(b->ref);
    return 0;
}

static int bound_clear(BoundPush *b) {
    Py_CLEAR(b->plan);
    Py_CLEAR(b->self);
    Py_CLEAR(b->func);
    Py_CLEAR(b->ref);
    return 0;
}

static void bound_dealloc(BoundPush *b) {
    PyObject_GC_UnTrack(b);
    bound_clear(b);
    PyObject_GC_Del(b);
}

static PyObject *bound_repr(BoundPush *b) {
    PyObject *self = bound_self(b);
    PyObject *name = self ? PyObject_GetAttrString(b->func, "__qualname__") : NULL;
    if (!name) return NULL;
    PyObject *r = PyUnicode_FromFormat("<bound method %S of %R>", name, self);
    Py_DECREF(name);
    return r;
}

/* pickled as a bound method is: getattr(buffer, name), so an unpickled push holds its buffer */
static PyObject *bound_reduce(BoundPush *b, PyObject *unused) {
    PyObject *self = bound_self(b);
    PyObject *name = self ? PyObject_GetAttrString(b->func, "__name__") : NULL;
    if (!name) return NULL;
    PyObject *builtins = PyEval_GetBuiltins(); /* borrowed */
    PyObject *getattr_ = builtins ? PyDict_GetItemString(builtins, "getattr") : NULL;
    if (!getattr_) {
        Py_DECREF(name);
        PyErr_SetString(PyExc_RuntimeError, "push: builtins.getattr not found");
        return NULL;
    }
    return Py_BuildValue("(O(ON))", getattr_, self, name);
}

static PyObject *bound_self_get(BoundPush *b, void *unused) {
    PyObject *self = bound_self(b);
    Py_XINCREF(self);
    return self;
}

static PyObject *bound_doc(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__doc__"); }
static PyObject *bound_name(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__name__"); }
static PyObject *bound_qualname(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__qualname__"); }
static PyObject *bound_module(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__module__"); }

/* inspect.signature(buf.push): the method's, bound (without self) */
static PyObject *bound_signature(BoundPush *b, void *unused) {
    PyObject *self = bound_self(b);
    PyObject *inspect = self ? PyImport_ImportModule("inspect") : NULL;
    if (!inspect) return NULL;
    PyObject *method = PyMethod_New(b->func, self);
    PyObject *sig = method ? PyObject_CallMethod(inspect, "signature", "O", method) : NULL;
    Py_XDECREF(method);
    Py_DECREF(inspect);
    return sig;
}

/* equal, as bound methods are, when they bind the same function to the same buffer */
static PyObject *bound_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(b) != Py_TYPE(a)) Py_RETURN_NOTIMPLEMENTED;
    BoundPush *x = (BoundPush *)a, *y = (BoundPush *)b;
    PyObject *xs = bound_self(x), *ys = xs ? bound_self(y) : NULL;
    if (!ys) return NULL;
    int eq = xs == ys && x->func == y->func;
    if (op == Py_NE) eq = !eq;
    return PyBool_FromLong(eq);
}

static Py_hash_t bound_hash(BoundPush *b) {
    PyObject *self = bound_self(b);
    Py_hash_t x = self ? PyObject_Hash(b->func) : -1;
    if (x == -1) return -1;
    uintptr_t p = (uintptr_t)self; /* as CPython hashes a pointer: rotated by 4 bits */
    Py_hash_t y = (Py_hash_t)((p >> 4) | (p << (8 * sizeof(p) - 4)));
    Py_hash_t h = x ^ y;
    return h == -1 ? -2 : h;
}

/* BoundPush(func, buffer): func bound to buffer, holding it, with no plan (weakref.WeakMethod
 * rebuilds a bound method this way) */
static PyObject *bound_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *func, *self;
    if ((kwds && PyDict_GET_SIZE(kwds)) || !PyArg_ParseTuple(args, "OO:BoundPush", &func, &self)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "BoundPush(func, buffer) takes no keywords");
        return NULL;
    }
    BoundPush *b = PyObject_GC_New(BoundPush, &BoundPushType);
    if (!b) return NULL;
    b->plan = b->ref = NULL;
    Py_INCREF(self);
    b->self = self;
    Py_INCREF(func);
    b->func = func;
    b->vectorcall = bound_call;
    PyObject_GC_Track(b);
    return (PyObject *)b;
}

static PyMemberDef bound_members[] = {
    {"__func__", T_OBJECT, offsetof(BoundPush, func), READONLY, "the Python method (ReplayBuffer.push)"},
    {NULL, 0, 0, 0, NULL},
};
static PyGetSetDef bound_getset[] = {
    {"__self__", (getter)bound_self_get, NULL, "the buffer", NULL},
    {"__doc__", (getter)bound_doc, NULL, NULL, NULL},
    {"__name__", (getter)bound_name, NULL, NULL, NULL},
    {"__qualname__", (getter)bound_qualname, NULL, NULL, NULL},
    {"__module__", (getter)bound_module, NULL, NULL, NULL},
    {"__signature__", (getter)bound_signature, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};
static PyMethodDef bound_methods[] = {
    {"__reduce__", (PyCFunction)bound_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyTypeObject BoundPushType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmbuffer.native._native.BoundPush",
    .tp_basicsize = sizeof(BoundPush),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A buffer's push: a bound method whose usual calls run in C (PushMethod).",
    .tp_vectorcall_offset = offsetof(BoundPush, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)bound_traverse,
    .tp_clear = (inquiry)bound_clear,
    .tp_dealloc = (destructor)bound_dealloc,
    .tp_repr = (reprfunc)bound_repr,
    .tp_richcompare = bound_richcompare,
    .tp_hash = (hashfunc)bound_hash,
    .tp_new = bound_new,
    .tp_members = bound_members,
    .tp_getset = bound_getset,
    .tp_methods = bound_methods,
};

static PyObject *method_get(PushMethod *m, PyObject *obj, PyObject *type) {
    if (!m->func) {
        PyErr_SetString(PyExc_TypeError, "PushMethod: made without its function (PushMethod(func))");
        return NULL;
    }
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(m->func);
        return m->func;
    }
    return PyMethod_New(m->func, obj);
}

/* PushMethod.seat(buffer, plan): buffer's resident BoundPush, for its __dict__ (see the top) */
static PyObject *method_seat(PushMethod *m, PyObject *args) {
    PyObject *obj, *plan;
    if (!PyArg_ParseTuple(args, "OO:seat", &obj, &plan)) return NULL;
    if (!m->func) {
        PyErr_SetString(PyExc_TypeError, "PushMethod: made without its function (PushMethod(func))");
        return NULL;
    }
    if (plan != Py_None && !PyCapsule_IsValid(plan, PLAN_CAPSULE)) {
        PyErr_SetString(PyExc_TypeError, "seat(buffer, plan): plan must be a push plan or None");
        return NULL;
    }
    PyObject *ref = PyWeakref_NewRef(obj, NULL);
    if (!ref) return NULL;
    BoundPush *b = PyObject_GC_New(BoundPush, &BoundPushType);
    if (!b) {
        Py_DECREF(ref);
        return NULL;
    }
    b->plan = plan == Py_None ? NULL : plan;
    Py_XINCREF(b->plan);
    b->self = NULL;
    b->ref = ref;
    Py_INCREF(m->func);
    b->func = m->func;
    b->vectorcall = bound_call;
    PyObject_GC_Track(b);
    return (PyObject *)b;
}

/* PushMethod.unseat(buffer): take buffer's resident push out of its __dict__; held elsewhere,
 * it keeps the buffer from now on (a strong reference: at __del__, the buffer lives on). A
 * buffer found by the cycle collector has lost its weak references before its __del__: its
 * push, if held elsewhere, then raises ReferenceError rather than bring back a buffer whose
 * finalizers have run. */
static PyObject *method_unseat(PushMethod *m, PyObject *obj) {
    static PyObject *s_push;
    if (!s_push && !(s_push = PyUnicode_InternFromString("push"))) return NULL;
    PyObject *dict = PyObject_GenericGetDict(obj, NULL);
    if (!dict) return NULL;
    PyObject *found = PyDict_GetItemWithError(dict, s_push); /* borrowed: the dict's is its only count */
    int err = !found && PyErr_Occurred() ? -1 : 0;
    if (found && Py_TYPE(found) == &BoundPushType && !((BoundPush *)found)->self) {
        BoundPush *b = (BoundPush *)found;
        if (Py_REFCNT(found) > 1 && PyWeakref_GetObject(b->ref) == obj) {
            Py_INCREF(obj);
            b->self = obj;
            Py_CLEAR(b->ref);
        }
        err = PyDict_DelItem(dict, s_push);
    }
    Py_DECREF(dict);
    if (err) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef method_methods[] = {
    {"seat", (PyCFunction)method_seat, METH_VARARGS, "seat(buffer, plan): buffer's push, for its __dict__ (weak until it leaves it)."},
    {"unseat", (PyCFunction)method_unseat, METH_O, "unseat(buffer): take buffer's seated push out of its __dict__."},
    {NULL, NULL, 0, NULL},
};

static int method_init(PushMethod *m, PyObject *args, PyObject *kwds) {
    PyObject *func;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "PushMethod(func) takes no keywords");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O:PushMethod", &func)) return -1;
    if (!PyCallable_Check(func)) {
        PyErr_SetString(PyExc_TypeError, "PushMethod(func): func must be callable");
        return -1;
    }
    Py_INCREF(func);
    Py_XSETREF(m->func, func);
    return 0;
}

static int method_traverse(PushMethod *m, visitproc visit, void *arg) {
    Py_VISIT(m->func);
    return 0;
}

static int method_clear(PushMethod *m) {
    Py_CLEAR(m->func);
    return 0;
}

static void method_dealloc(PushMethod *m) {
    PyObject_GC_UnTrack(m);
    method_clear(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyObject *method_doc(PushMethod *m, void *unused) {
    if (!m->func) Py_RETURN_NONE;
    return PyObject_GetAttrString(m->func, "__doc__");
}

static PyMemberDef method_members[] = {
    {"__func__", T_OBJECT, offsetof(PushMethod, func), READONLY, "the Python method"},
    {NULL, 0, 0, 0, NULL},
};
static PyGetSetDef method_getset[] = {
    {"__doc__", (getter)method_doc, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject PushMethodType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmbuffer.native._native.PushMethod",
    .tp_basicsize = sizeof(PushMethod),
    /* not a method descriptor: CPython then specialises the read of a seated `buf.push` */
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "PushMethod(func): ReplayBuffer.push on the class; each buffer seats a BoundPush in its __dict__.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)method_init,
    .tp_traverse = (traverseproc)method_traverse,
    .tp_clear = (inquiry)method_clear,
    .tp_dealloc = (destructor)method_dealloc,
    .tp_descr_get = (descrgetfunc)method_get,
    .tp_members = method_members,
    .tp_getset = method_getset,
    .tp_methods = method_methods,
};
