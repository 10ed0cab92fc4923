/* SPDX-License-Identifier: Apache-2.0 */
/*
 * native_io.ReadProgress: how far a Reader.read has come, for a consumer on
 * another thread (CPython glue; read_progress.c).
 */
#ifndef NATIVE_IO_READ_PROGRESS_H
#define NATIVE_IO_READ_PROGRESS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "nio.h"

extern PyTypeObject ReadProgressType;

/* progress is a ReadProgress no read has used yet (GIL held; -1 with an exception set). */
int read_progress_check(PyObject *progress);
/* Attach a fresh progress to a read of nsegs segments (GIL held; -1 with an exception set). */
int read_progress_begin(PyObject *progress, size_t nsegs);
/* nio_read_progress_fn: record the segments done (no GIL); nonzero once cancel() was called. */
int read_progress_update(void *progress, const struct nio_rseg *segs, size_t done);
/* The read has returned, whatever its outcome: wake every waiter (any thread, GIL or not). */
void read_progress_end(PyObject *progress);

#endif /* NATIVE_IO_READ_PROGRESS_H */
