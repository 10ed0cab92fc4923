// SPDX-License-Identifier: Apache-2.0
/*
 * Staging arena and I/O context lifecycle.
 *
 * The arena is (qd + 1) blocks of block_size bytes, 4096-aligned, allocated
 * once per context; contexts are cached by the engine and reused for the
 * next file, so a process writing many checkpoints allocates it once.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "nio.h"

void *nio_aligned_alloc(size_t size)
{
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	if (p == MAP_FAILED)
		return NULL;
	return p; /* page aligned, which is NIO_ALIGN */
}

void nio_aligned_free(void *p, size_t size)
{
	if (p && munmap(p, size))
		perror("native_io: munmap");
}

int nio_ctx_create(int kind, size_t block_size, unsigned qd, struct nio_ctx **out, char *why,
		   size_t whylen)
{
	struct nio_ctx *ctx;
	int err;

	*out = NULL;
	ctx = calloc(1, sizeof(*ctx));
	if (!ctx) {
		snprintf(why, whylen, "out of memory");
		return ENOMEM;
	}
	ctx->kind = kind;
	ctx->pid = getpid();
	ctx->block_size = block_size;
	ctx->qd = qd;
	ctx->nslots = qd + 1;
	ctx->nreqs = ctx->nslots > NIO_WRITE_REQS ? ctx->nslots : NIO_WRITE_REQS;
	ctx->arena_size = (size_t)ctx->nslots * block_size;
	ctx->reqs = calloc(ctx->nreqs, sizeof(*ctx->reqs));
	ctx->arena = nio_aligned_alloc(ctx->arena_size);
	if (!ctx->reqs || !ctx->arena) {
		snprintf(why, whylen, "cannot allocate %zu byte staging arena", ctx->arena_size);
		err = ENOMEM;
		goto fail;
	}
	if (kind == NIO_URING)
		err = nio_uring_init(ctx, why, whylen);
	else
		err = nio_portable_init(ctx, why, whylen);
	if (err)
		goto fail;
	*out = ctx;
	return 0;
fail:
	nio_aligned_free(ctx->arena, ctx->arena_size);
	free(ctx->reqs);
	free(ctx);
	return err;
}

void nio_ctx_destroy(struct nio_ctx *ctx)
{
	if (!ctx)
		return;
	/* never free memory the kernel may still write into */
	if (ctx->inflight && nio_drain(ctx))
		ctx->broken = 1;
	if (ctx->be)
		ctx->be->destroy(ctx);
	if (ctx->inflight) {
		/* backend could not be drained: leak rather than corrupt */
		fprintf(stderr, "native_io: leaking arena with %u transfers in flight\n",
			ctx->inflight);
		return;
	}
	nio_aligned_free(ctx->arena, ctx->arena_size);
	free(ctx->reqs);
	free(ctx);
}
