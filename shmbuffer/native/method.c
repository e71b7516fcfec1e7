/* ReplayBuffer.push as a method whose usual calls run in C.
 *
 * PushMethod(func) stands for ReplayBuffer.push on the class (buffer.py). Read from an
 * instance whose `_push_plan` is a plan (ReplayBuffer._setup: a uniform buffer the one call
 * serves), it gives a BoundPush: a bound method, holding its buffer as any bound method does,
 * whose usual calls are push_from_args (push.c) and every other call func(buffer, ...). Read
 * from the class, it is func; from an instance without a plan, func bound as usual.
 *
 * A buffer with a plan also keeps one BoundPush in its own __dict__ (PushMethod.seat), so that
 * `buf.push` is an instance attribute: no descriptor call and no object made per read (a
 * `buf.push(**row)` reads it once a call). That one is resident: it refers to its buffer by a
 * weak reference, since a strong one would make a cycle and the buffer would outlive `del buf`
 * (its block unlinked only by the cycle collector). It reads the plan from the buffer at each
 * call (`_push_plan`, the switch tests and close() turn off). When it leaves the __dict__
 * (PushMethod.unseat: close(), or the buffer's __del__) while held elsewhere, it takes a strong
 * reference, so a push read from a buffer keeps that buffer alive as a bound method does; at
 * __del__ that resurrects the buffer (PEP 442) until the push is dropped. */
#include "native.h"

#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *func;
    vectorcallfunc vectorcall;
} PushMethod;

typedef struct {
    PyObject_HEAD
    PyObject *plan, *self, *func;
    PyObject *ref; /* resident (self NULL, plan NULL): a weak reference to the buffer */
    vectorcallfunc vectorcall;
} BoundPush;

/* the buffer (borrowed), or NULL with an error when a resident push's buffer is gone (its
 * __dict__ entry replaced by hand and the buffer dropped: unseat never ran) */
static PyObject *bound_self(BoundPush *b) {
    if (b->self) return b->self;
    PyObject *obj = PyWeakref_GetObject(b->ref);
    if (obj == Py_None) {
        PyErr_SetString(PyExc_ReferenceError, "push: its buffer was dropped");
        return NULL;
    }
    return obj;
}

static PyObject *plan_on(PyObject *obj);

static PyObject *bound_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    BoundPush *b = (BoundPush *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *self = bound_self(b);
    if (!self) return NULL;
    Py_INCREF(self); /* a resident push's buffer held through the call, whatever the call drops */
    PyObject *plan = b->plan, *got = NULL;
    if (plan) Py_INCREF(plan);
    else if (!(plan = plan_on(self)) && PyErr_Occurred()) goto done;
    if (plan) {
        PushPlan *p = plan_of(plan);
        got = p ? push_from_args(p, args, nargs, kwnames) : NULL;
        Py_DECREF(plan);
        if (got != Py_None) goto done; /* the ids, or NULL with an error */
        Py_CLEAR(got);
    }
    PyObject *method = PyMethod_New(b->func, self);
    if (method) {
        got = PyObject_Vectorcall(method, args, (size_t)nargs, kwnames);
        Py_DECREF(method);
    }
done:
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

/* one BoundPush kept from its dealloc for the next method_get: `buffer.push(**row)` binds one per
 * call, and reusing it spares the allocation and the GC's count toward its next collection */
static BoundPush *spare;

static void bound_dealloc(BoundPush *b) {
    PyObject_GC_UnTrack(b);
    bound_clear(b);
    if (!spare && Py_TYPE(b) == &BoundPushType) {
        spare = b;
        return;
    }
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

/* the plan `obj._push_plan` holds (a new reference), or NULL (no error set) when it holds none */
static PyObject *plan_on(PyObject *obj) {
    static PyObject *s_plan;
    if (!s_plan && !(s_plan = PyUnicode_InternFromString("_push_plan"))) return NULL;
    /* the generic lookup: ReplayBuffer's __getattr__ (hints for other libraries' names) would
     * otherwise wrap every push's lookup, though it never answers for this name */
    PyObject *plan = PyObject_GenericGetAttr(obj, s_plan);
    if (!plan) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
        return NULL;
    }
    if (PyCapsule_IsValid(plan, PLAN_CAPSULE)) return plan;
    Py_DECREF(plan);
    return NULL;
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
    PyObject *plan = plan_on(obj);
    if (!plan) return PyErr_Occurred() ? NULL : PyMethod_New(m->func, obj);
    BoundPush *b = spare;
    if (b) {
        spare = NULL;
        _Py_NewReference((PyObject *)b);
    } else if (!(b = PyObject_GC_New(BoundPush, &BoundPushType))) {
        Py_DECREF(plan);
        return NULL;
    }
    b->plan = plan;
    Py_INCREF(obj);
    b->self = obj;
    Py_INCREF(m->func);
    b->func = m->func;
    b->ref = NULL;
    b->vectorcall = bound_call;
    PyObject_GC_Track(b);
    return (PyObject *)b;
}

/* buffer.push(...) itself: the type is a method descriptor, so a call through an instance comes
 * here with the instance first and no BoundPush is made (an allocation per call, each counted
 * toward the GC's next collection); the same calls as bound_call */
static PyObject *method_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PushMethod *m = (PushMethod *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (!m->func) {
        PyErr_SetString(PyExc_TypeError, "PushMethod: made without its function (PushMethod(func))");
        return NULL;
    }
    PyObject *plan = nargs ? plan_on(args[0]) : NULL;
    if (plan) {
        PushPlan *p = plan_of(plan);
        PyObject *ids = p ? push_from_args(p, args + 1, nargs - 1, kwnames) : NULL;
        Py_DECREF(plan);
        if (ids != Py_None) return ids; /* the ids, or NULL with an error */
        Py_DECREF(ids);
    } else if (PyErr_Occurred()) {
        return NULL;
    }
    return PyObject_Vectorcall(m->func, args, (size_t)nargs, kwnames);
}

/* PushMethod.seat(buffer): a resident BoundPush of buffer, for its __dict__ (see the top) */
static PyObject *method_seat(PushMethod *m, PyObject *obj) {
    if (!m->func) {
        PyErr_SetString(PyExc_TypeError, "PushMethod: made without its function (PushMethod(func))");
        return NULL;
    }
    PyObject *ref = PyWeakref_NewRef(obj, NULL);
    if (!ref) return NULL;
    BoundPush *b = PyObject_GC_New(BoundPush, &BoundPushType);
    if (!b) {
        Py_DECREF(ref);
        return NULL;
    }
    b->plan = b->self = NULL;
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
    {"seat", (PyCFunction)method_seat, METH_O, "seat(buffer): a push bound to buffer, for its __dict__ (weak until it leaves)."},
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
    m->vectorcall = method_call;
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
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(PushMethod, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_doc = "PushMethod(func): ReplayBuffer.push on the class; a BoundPush on an instance with a push plan.",
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
