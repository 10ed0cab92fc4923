/* SPDX-License-Identifier: Apache-2.0 */
/*
 * native_io.Span: a buffer over memory another object owns (span.c).
 */
#ifndef NATIVE_IO_SPAN_H
#define NATIVE_IO_SPAN_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern PyTypeObject SpanType;

#endif /* NATIVE_IO_SPAN_H */
