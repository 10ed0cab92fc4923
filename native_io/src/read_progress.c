// SPDX-License-Identifier: Apache-2.0
/*
 * native_io.ReadProgress: one Reader.read(segments, progress=p) reports into
 * it after every transfer it retires; another thread waits in p.wait(n) until
 * the first n segments are read and takes their CRC-32C from p.crc(i). So a
 * load hands each storage to its unpickler as soon as it is read, while the
 * read itself stays one call whose queue never drains between batches.
 */
#include <errno.h>
#include <pthread.h>
#include <time.h>
#include "read_progress.h"

enum { PROGRESS_NEW, PROGRESS_READING, PROGRESS_ENDED };

/* Waiters wake at least this often to let Python handle signals (Ctrl-C). */
#define WAIT_SLICE_NS 50000000L

typedef struct {
	PyObject_HEAD
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int state;
	int cancel;
	size_t nsegs;
	size_t done;	/* leading segments read, their crc final */
	uint32_t *crcs; /* nsegs entries, [0, done) valid */
} ReadProgressObject;

static int ReadProgress_init(ReadProgressObject *self, PyObject *args, PyObject *kwds)
{
	static char *kwlist[] = { NULL };
	pthread_condattr_t attr;

	if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist))
		return -1;
	if (self->state != -1) {
		PyErr_SetString(PyExc_RuntimeError, "ReadProgress is initialized once");
		return -1;
	}
	pthread_mutex_init(&self->mu, NULL);
	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_cond_init(&self->cv, &attr);
	pthread_condattr_destroy(&attr);
	self->state = PROGRESS_NEW;
	self->cancel = 0;
	self->nsegs = 0;
	self->done = 0;
	return 0;
}

static PyObject *ReadProgress_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
	ReadProgressObject *self = (ReadProgressObject *)type->tp_alloc(type, 0);

	if (self)
		self->state = -1; /* until __init__ has set up the lock */
	return (PyObject *)self;
}

static void ReadProgress_dealloc(ReadProgressObject *self)
{
	if (self->state != -1) {
		pthread_cond_destroy(&self->cv);
		pthread_mutex_destroy(&self->mu);
	}
	PyMem_RawFree(self->crcs);
	Py_TYPE(self)->tp_free((PyObject *)self);
}

int read_progress_check(PyObject *progress)
{
	ReadProgressObject *p = (ReadProgressObject *)progress;
	int state;

	if (!PyObject_TypeCheck(progress, &ReadProgressType) || p->state == -1) {
		PyErr_SetString(PyExc_TypeError, "progress must be a native_io.ReadProgress()");
		return -1;
	}
	pthread_mutex_lock(&p->mu);
	state = p->state;
	pthread_mutex_unlock(&p->mu);
	if (state != PROGRESS_NEW) {
		PyErr_SetString(PyExc_ValueError,
				"a ReadProgress follows one read: make a new one for this read");
		return -1;
	}
	return 0;
}

int read_progress_begin(PyObject *progress, size_t nsegs)
{
	ReadProgressObject *p = (ReadProgressObject *)progress;
	uint32_t *crcs;

	crcs = PyMem_RawCalloc(nsegs ? nsegs : 1, sizeof(*crcs));
	if (!crcs) {
		PyErr_NoMemory();
		return -1;
	}
	pthread_mutex_lock(&p->mu);
	if (p->state != PROGRESS_NEW) {
		pthread_mutex_unlock(&p->mu);
		PyMem_RawFree(crcs);
		PyErr_SetString(PyExc_ValueError,
				"a ReadProgress follows one read: make a new one for this read");
		return -1;
	}
	p->crcs = crcs;
	p->nsegs = nsegs;
	p->state = PROGRESS_READING;
	pthread_mutex_unlock(&p->mu);
	return 0;
}

int read_progress_update(void *progress, const struct nio_rseg *segs, size_t done)
{
	ReadProgressObject *p = progress;
	int cancel;

	pthread_mutex_lock(&p->mu);
	if (done > p->done) {
		for (size_t i = p->done; i < done; i++)
			p->crcs[i] = segs[i].crc;
		p->done = done;
		pthread_cond_broadcast(&p->cv);
	}
	cancel = p->cancel;
	pthread_mutex_unlock(&p->mu);
	return cancel;
}

void read_progress_end(PyObject *progress)
{
	ReadProgressObject *p = (ReadProgressObject *)progress;

	pthread_mutex_lock(&p->mu);
	p->state = PROGRESS_ENDED;
	pthread_cond_broadcast(&p->cv);
	pthread_mutex_unlock(&p->mu);
}

static PyObject *ReadProgress_wait(ReadProgressObject *self, PyObject *args)
{
	Py_ssize_t want;
	size_t done;
	int waiting;

	if (!PyArg_ParseTuple(args, "n", &want))
		return NULL;
	if (want < 0) {
		PyErr_Format(PyExc_ValueError, "wait(n): n must be >= 0, got %zd", want);
		return NULL;
	}
	if (self->state == -1) {
		PyErr_SetString(PyExc_ValueError, "ReadProgress was not initialized");
		return NULL;
	}
	/* Already there (the usual case once the reads run ahead): answer without giving up the GIL, which
	 * another thread of the process (a heartbeat) could then hold for a whole switch interval. */
	pthread_mutex_lock(&self->mu);
	done = self->done;
	waiting = done < (size_t)want && self->state != PROGRESS_ENDED;
	pthread_mutex_unlock(&self->mu);
	while (waiting) {
		Py_BEGIN_ALLOW_THREADS
		struct timespec until;

		clock_gettime(CLOCK_MONOTONIC, &until);
		until.tv_nsec += WAIT_SLICE_NS;
		if (until.tv_nsec >= 1000000000L) {
			until.tv_sec++;
			until.tv_nsec -= 1000000000L;
		}
		pthread_mutex_lock(&self->mu);
		while (self->done < (size_t)want && self->state != PROGRESS_ENDED &&
		       pthread_cond_timedwait(&self->cv, &self->mu, &until) != ETIMEDOUT)
			;
		done = self->done;
		waiting = done < (size_t)want && self->state != PROGRESS_ENDED;
		pthread_mutex_unlock(&self->mu);
		Py_END_ALLOW_THREADS
		if (waiting && PyErr_CheckSignals())
			return NULL;
	}
	return PyLong_FromSize_t(done);
}

static PyObject *ReadProgress_crc(ReadProgressObject *self, PyObject *arg)
{
	Py_ssize_t i = PyLong_AsSsize_t(arg);
	uint32_t crc;
	size_t done;

	if (i == -1 && PyErr_Occurred())
		return NULL;
	if (self->state == -1) {
		PyErr_SetString(PyExc_ValueError, "ReadProgress was not initialized");
		return NULL;
	}
	pthread_mutex_lock(&self->mu);
	done = self->done;
	crc = i >= 0 && (size_t)i < done ? self->crcs[i] : 0;
	pthread_mutex_unlock(&self->mu);
	if (i < 0 || (size_t)i >= done) {
		PyErr_Format(PyExc_IndexError, "segment %zd is not read yet (%zu done)", i, done);
		return NULL;
	}
	return PyLong_FromUnsignedLong(crc);
}

static PyObject *ReadProgress_cancel(ReadProgressObject *self, PyObject *unused)
{
	if (self->state != -1) {
		pthread_mutex_lock(&self->mu);
		self->cancel = 1;
		pthread_mutex_unlock(&self->mu);
	}
	Py_RETURN_NONE;
}

static PyObject *ReadProgress_end(ReadProgressObject *self, PyObject *unused)
{
	if (self->state != -1)
		read_progress_end((PyObject *)self);
	Py_RETURN_NONE;
}

static PyObject *ReadProgress_get_done(ReadProgressObject *self, void *closure)
{
	size_t done = 0;

	if (self->state != -1) {
		pthread_mutex_lock(&self->mu);
		done = self->done;
		pthread_mutex_unlock(&self->mu);
	}
	return PyLong_FromSize_t(done);
}

static PyObject *ReadProgress_get_ended(ReadProgressObject *self, void *closure)
{
	int ended = 0;

	if (self->state != -1) {
		pthread_mutex_lock(&self->mu);
		ended = self->state == PROGRESS_ENDED;
		pthread_mutex_unlock(&self->mu);
	}
	return PyBool_FromLong(ended);
}

static PyMethodDef ReadProgress_methods[] = {
	{ "wait", (PyCFunction)ReadProgress_wait, METH_VARARGS,
	  "wait(n) -> int: block (without the GIL) until the first n segments are read or the read "
	  "has ended; return how many are read" },
	{ "crc", (PyCFunction)ReadProgress_crc, METH_O,
	  "crc(i) -> int: the CRC-32C of segment i, once it is read (IndexError before)" },
	{ "cancel", (PyCFunction)ReadProgress_cancel, METH_NOARGS,
	  "cancel(): the read submits nothing more and fails with ECANCELED once its transfers "
	  "in flight have landed" },
	{ "end", (PyCFunction)ReadProgress_end, METH_NOARGS,
	  "end(): no read reports here any more (one that failed before it began, in Python): wake "
	  "the waiters; Reader.read ends it itself" },
	{ NULL },
};

static PyGetSetDef ReadProgress_getset[] = {
	{ "done", (getter)ReadProgress_get_done, NULL, "leading segments read, their crc final",
	  NULL },
	{ "ended", (getter)ReadProgress_get_ended, NULL,
	  "the read has returned (done, failed or cancelled)", NULL },
	{ NULL },
};

PyTypeObject ReadProgressType = {
	PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native_io.ReadProgress",
	.tp_basicsize = sizeof(ReadProgressObject),
	.tp_flags = Py_TPFLAGS_DEFAULT,
	.tp_doc = "ReadProgress(): pass to Reader.read(segments, progress=...) to use the leading "
		  "segments on another thread while the rest are read (one read per object)",
	.tp_new = ReadProgress_new,
	.tp_init = (initproc)ReadProgress_init,
	.tp_dealloc = (destructor)ReadProgress_dealloc,
	.tp_methods = ReadProgress_methods,
	.tp_getset = ReadProgress_getset,
};
