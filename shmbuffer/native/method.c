/* ReplayBuffer.push as a method whose usual calls run in C.
 *
 * PushMethod(func) stands for ReplayBuffer.push on the class (buffer.py). Read from an
 * instance whose `_push_plan` is a plan (ReplayBuffer._setup: a uniform buffer the one call
 * serves), it gives a BoundPush: a bound method, holding its buffer as any bound method does,
 * whose usual calls are push_from_args (push.c) and every other call func(buffer, ...). Read
 * from the class, it is func; from an instance without a plan, func bound as usual. */
#include "native.h"

#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *func;
} PushMethod;

typedef struct {
    PyObject_HEAD
    PyObject *plan, *self, *func;
    vectorcallfunc vectorcall;
} BoundPush;

static PyObject *bound_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    BoundPush *b = (BoundPush *)callable;
    PushPlan *p = plan_of(b->plan);
    if (!p) return NULL;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *ids = push_from_args(p, args, nargs, kwnames);
    if (ids != Py_None) return ids; /* the ids, or NULL with an error */
    Py_DECREF(ids);
    PyObject *method = PyMethod_New(b->func, b->self);
    if (!method) return NULL;
    PyObject *got = PyObject_Vectorcall(method, args, (size_t)nargs, kwnames);
    Py_DECREF(method);
    return got;
}

static int bound_traverse(BoundPush *b, visitproc visit, void *arg) {
    Py_VISIT(b->plan);
    Py_VISIT(b->self);
    Py_VISIT(b->func);
    return 0;
}

static int bound_clear(BoundPush *b) {
    Py_CLEAR(b->plan);
    Py_CLEAR(b->self);
    Py_CLEAR(b->func);
    return 0;
}

static void bound_dealloc(BoundPush *b) {
    PyObject_GC_UnTrack(b);
    bound_clear(b);
    PyObject_GC_Del(b);
}

static PyObject *bound_repr(BoundPush *b) {
    PyObject *name = PyObject_GetAttrString(b->func, "__qualname__");
    if (!name) return NULL;
    PyObject *r = PyUnicode_FromFormat("<bound method %S of %R>", name, b->self);
    Py_DECREF(name);
    return r;
}

/* pickled as a bound method is: getattr(buffer, name), so an unpickled push holds its buffer */
static PyObject *bound_reduce(BoundPush *b, PyObject *unused) {
    PyObject *name = PyObject_GetAttrString(b->func, "__name__");
    if (!name) return NULL;
    PyObject *builtins = PyEval_GetBuiltins(); /* borrowed */
    PyObject *getattr_ = builtins ? PyDict_GetItemString(builtins, "getattr") : NULL;
    if (!getattr_) {
        Py_DECREF(name);
        PyErr_SetString(PyExc_RuntimeError, "push: builtins.getattr not found");
        return NULL;
    }
    return Py_BuildValue("(O(ON))", getattr_, b->self, name);
}

static PyObject *bound_doc(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__doc__"); }
static PyObject *bound_name(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__name__"); }
static PyObject *bound_qualname(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__qualname__"); }
static PyObject *bound_module(BoundPush *b, void *unused) { return PyObject_GetAttrString(b->func, "__module__"); }

/* inspect.signature(buf.push): the method's, bound (without self) */
static PyObject *bound_signature(BoundPush *b, void *unused) {
    PyObject *inspect = PyImport_ImportModule("inspect");
    if (!inspect) return NULL;
    PyObject *method = PyMethod_New(b->func, b->self);
    PyObject *sig = method ? PyObject_CallMethod(inspect, "signature", "O", method) : NULL;
    Py_XDECREF(method);
    Py_DECREF(inspect);
    return sig;
}

/* equal, as bound methods are, when they bind the same function to the same buffer */
static PyObject *bound_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(b) != Py_TYPE(a)) Py_RETURN_NOTIMPLEMENTED;
    BoundPush *x = (BoundPush *)a, *y = (BoundPush *)b;
    int eq = x->self == y->self && x->func == y->func;
    if (op == Py_NE) eq = !eq;
    return PyBool_FromLong(eq);
}

static Py_hash_t bound_hash(BoundPush *b) {
    Py_hash_t x = PyObject_Hash(b->func);
    if (x == -1) return -1;
    uintptr_t p = (uintptr_t)b->self; /* as CPython hashes a pointer: rotated by 4 bits */
    Py_hash_t y = (Py_hash_t)((p >> 4) | (p << (8 * sizeof(p) - 4)));
    Py_hash_t h = x ^ y;
    return h == -1 ? -2 : h;
}

static PyObject *method_get(PushMethod *m, PyObject *obj, PyObject *type);

/* BoundPush(func, buffer): func bound to buffer, as PushMethod binds it (weakref.WeakMethod
 * rebuilds a bound method this way) */
static PyObject *bound_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *func, *self;
    if ((kwds && PyDict_GET_SIZE(kwds)) || !PyArg_ParseTuple(args, "OO:BoundPush", &func, &self)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "BoundPush(func, buffer) takes no keywords");
        return NULL;
    }
    PushMethod m;
    m.func = func;
    return method_get(&m, self, NULL);
}

static PyMemberDef bound_members[] = {
    {"__self__", T_OBJECT, offsetof(BoundPush, self), READONLY, "the buffer"},
    {"__func__", T_OBJECT, offsetof(BoundPush, func), READONLY, "the Python method (ReplayBuffer.push)"},
    {NULL, 0, 0, 0, NULL},
};
static PyGetSetDef bound_getset[] = {
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
    static PyObject *s_plan;
    if (!s_plan && !(s_plan = PyUnicode_InternFromString("_push_plan"))) return NULL;
    if (!m->func) {
        PyErr_SetString(PyExc_TypeError, "PushMethod: made without its function (PushMethod(func))");
        return NULL;
    }
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(m->func);
        return m->func;
    }
    PyObject *plan = PyObject_GetAttr(obj, s_plan);
    if (!plan) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
    }
    if (!plan || !PyCapsule_IsValid(plan, PLAN_CAPSULE)) {
        Py_XDECREF(plan);
        return PyMethod_New(m->func, obj);
    }
    BoundPush *b = PyObject_GC_New(BoundPush, &BoundPushType);
    if (!b) {
        Py_DECREF(plan);
        return NULL;
    }
    b->plan = plan;
    Py_INCREF(obj);
    b->self = obj;
    Py_INCREF(m->func);
    b->func = m->func;
    b->vectorcall = bound_call;
    PyObject_GC_Track(b);
    return (PyObject *)b;
}

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
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "PushMethod(func): ReplayBuffer.push on the class; a BoundPush on an instance with a push plan.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)method_init,
    .tp_traverse = (traverseproc)method_traverse,
    .tp_clear = (inquiry)method_clear,
    .tp_dealloc = (destructor)method_dealloc,
    .tp_descr_get = (descrgetfunc)method_get,
    .tp_members = method_members,
    .tp_getset = method_getset,
};
