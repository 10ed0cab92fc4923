// SPDX-License-Identifier: Apache-2.0
/*
 * native_io.Span(owner, address, nbytes): a writable buffer over the nbytes
 * at address, which owner's memory holds (a torch storage: its data_ptr() and
 * nbytes()); the Span keeps owner alive for as long as it or a view of it
 * lives. Reader.read and Writer.write take any buffer; a Span costs a tenth of
 * a NumPy view over a storage (a tensor set to it, then .numpy()), which a
 * checkpoint of ten thousand small tensors pays once per tensor before its
 * first read can start.
 */
#include "span.h"

typedef struct {
	PyObject_HEAD
	PyObject *owner;
	char *address;
	Py_ssize_t nbytes;
	Py_ssize_t exports; /* views handed out and not released */
} SpanObject;

static int Span_init(SpanObject *self, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { "owner", "address", "nbytes", NULL };
	PyObject *owner;
	unsigned long long address;
	Py_ssize_t nbytes;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "OKn", kwlist, &owner, &address, &nbytes))
		return -1;
	if (self->exports) {
		PyErr_SetString(PyExc_BufferError, "a Span with views exported cannot be changed");
		return -1;
	}
	if (nbytes < 0) {
		PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, not %zd", nbytes);
		return -1;
	}
	if (address == 0 && nbytes > 0) {
		PyErr_SetString(PyExc_ValueError, "address 0 with nbytes > 0: no memory there");
		return -1;
	}
	if (address > (unsigned long long)UINTPTR_MAX ||
	    (unsigned long long)nbytes > (unsigned long long)UINTPTR_MAX - address) {
		PyErr_SetString(PyExc_ValueError, "address + nbytes overflows");
		return -1;
	}
	Py_INCREF(owner);
	Py_XSETREF(self->owner, owner);
	self->address = (char *)(uintptr_t)address;
	self->nbytes = nbytes;
	return 0;
}

static int Span_getbuffer(SpanObject *self, Py_buffer *view, int flags)
{
	if (!self->owner) {
		PyErr_SetString(PyExc_BufferError, "Span was not initialised");
		return -1;
	}
	if (PyBuffer_FillInfo(view, (PyObject *)self, self->address, self->nbytes, 0, flags) < 0)
		return -1;
	self->exports++;
	return 0;
}

static void Span_releasebuffer(SpanObject *self, Py_buffer *view)
{
	self->exports--;
}

static int Span_traverse(SpanObject *self, visitproc visit, void *arg)
{
	Py_VISIT(self->owner);
	return 0;
}

static int Span_clear(SpanObject *self)
{
	Py_CLEAR(self->owner);
	return 0;
}

static void Span_dealloc(SpanObject *self)
{
	PyObject_GC_UnTrack(self);
	Span_clear(self);
	Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Span_get_nbytes(SpanObject *self, void *closure)
{
	return PyLong_FromSsize_t(self->nbytes);
}

static PyObject *Span_get_owner(SpanObject *self, void *closure)
{
	return Py_NewRef(self->owner ? self->owner : Py_None);
}

static PyBufferProcs Span_as_buffer = {
	.bf_getbuffer = (getbufferproc)Span_getbuffer,
	.bf_releasebuffer = (releasebufferproc)Span_releasebuffer,
};

static PyGetSetDef Span_getset[] = {
	{ "nbytes", (getter)Span_get_nbytes, NULL, "the span's length in bytes", NULL },
	{ "owner", (getter)Span_get_owner, NULL, "the object whose memory it spans", NULL },
	{ NULL },
};

PyTypeObject SpanType = {
	PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native_io.Span",
	.tp_basicsize = sizeof(SpanObject),
	.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
	.tp_doc =
		"Span(owner, address, nbytes): a writable buffer over nbytes of memory at address "
		"that owner holds (e.g. a torch storage's data_ptr() and nbytes()); keeps owner "
		"alive. The caller vouches that the memory is owner's for as long as owner lives.",
	.tp_new = PyType_GenericNew,
	.tp_init = (initproc)Span_init,
	.tp_dealloc = (destructor)Span_dealloc,
	.tp_traverse = (traverseproc)Span_traverse,
	.tp_clear = (inquiry)Span_clear,
	.tp_as_buffer = &Span_as_buffer,
	.tp_getset = Span_getset,
};
