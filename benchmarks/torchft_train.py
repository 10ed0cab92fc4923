"""The ``torchft`` mode of ``python -m benchmarks.torchft_resilience``: one replica's training job.

torchft (https://github.com/pytorch/torchft, 0.2.0) is the closest open peer: replica groups that
come and go, a Rust *lighthouse* that forms a quorum of the live groups every step, a fault-tolerant
all-reduce whose failure makes the step uncommitted (``Manager.should_commit()`` returns False), and
live healing of a restarted group from a peer (state dict over HTTP). The benchmark driver
(``torchft_resilience.py``) starts the lighthouse (bound to 127.0.0.1) and one restart loop per replica;
each replica is one torchft replica group of one process running this script::

    python -m benchmarks.torchft_train --replica 1 --replicas 4 --lighthouse http://127.0.0.1:PORT \\
        --steps 40 --microbatches 12 --mb-seconds 0.1 --kill 1:5,2:16 --incarnation 1 --out DIR

Same model, data, seed, precision and microbatch contents as the other modes
(:func:`lightning_recover.bench.resilience_train.build_job`, :class:`~lightning_recover.data.MicrobatchSource`):
replica ``r`` computes microbatches ``r*M/N .. (r+1)*M/N - 1`` of the step it is at (the DDP baseline's
split); every microbatch is padded to ``--mb-seconds`` of wall time. Gradients are averaged with the
Manager's own ``allreduce`` (``ReduceOp.AVG``: divided by the number of *participants*) and the step is
applied only if ``should_commit()`` says so. torchft 0.2.0's ``DistributedDataParallel`` wrapper is not
used: when a peer dies mid-allreduce it crashes the survivors (``assert fut._fut`` in ``ddp.py``).

What torchft does by design, and this job keeps: while a replica is missing, a step covers only the
microbatches of the participants (the global batch shrinks, the average is over fewer samples); a
step whose all-reduce failed is dropped and recomputed from scratch by the next quorum; a restarted
replica heals from a peer at a quorum and contributes a zero gradient in that step.

Faults (``--kill R:S,...``): replica ``R`` SIGKILLs itself at the start of step ``S``'s backward
pass, in its first incarnation only (``--incarnation``, set by the driver's restart loop). A first
incarnation waits until all ``--replicas`` have created their Manager before its first quorum (the
start barrier torchrun's rendezvous gives the other modes); a restarted one joins at once.

Records (JSON lines in ``DIR/rank{r}.jsonl``): ``start``, ``step`` (one per attempt: ``step`` = the
manager step it ran at, ``committed``, ``participants``, ``participating``, ``healed``, start/commit
times, the step's mean loss over the participants); the replica that ends the run writes its final
parameters to ``DIR/final{r}.pt`` and ``DIR/done``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta

from lightning_recover.bench.resilience_train import (
    PROCESS_START,
    RecordLog,
    add_job_arguments,
    build_job,
    pad_microbatch,
)


def parse_kills(spec: str) -> dict[int, int]:
    """``"1:5,2:16"`` -> ``{1: 5, 2: 16}`` (replica -> step of its kill)."""
    kills = {}
    for item in (x for x in spec.split(",") if x):
        replica, step = item.split(":")
        kills[int(replica)] = int(step)
    return kills


def _barrier(out: str, replica: int, replicas: int, timeout: float) -> None:
    """First incarnations only: wait until every replica has its Manager (files in ``out``)."""
    open(os.path.join(out, f"ready{replica}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(out, f"ready{r}")) for r in range(replicas)):
        if time.monotonic() > deadline:
            raise SystemExit(f"torchft replica {replica}: the other replicas did not start within {timeout}s")
        time.sleep(0.02)


def run(args: argparse.Namespace) -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    r, n = args.replica, args.replicas
    if args.microbatches % n:
        raise SystemExit("the torchft mode needs microbatches divisible by replicas")
    per_rank = args.microbatches // n
    done_marker = os.path.join(args.out, "done")
    if os.path.exists(done_marker):  # restarted after the run ended: nothing to do
        return
    data, model, optimizer, source = build_job(args)
    if args.precision == "64-true":
        model.double()  # in place: the optimizer's parameters are the converted ones (Fabric does the same)
    params = [p for p in model.parameters() if p.requires_grad]
    log = RecordLog(args.out, f"rank{r}")
    log(event="start", t=PROCESS_START, attempt=0, incarnation=args.incarnation, ready=time.time())

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    # The replica group's own store (a group of one process: it hosts it itself).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=1,  # go on down to one survivor, as recover does
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica_{r}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
        heartbeat_interval=timedelta(milliseconds=100),
        timeout=timeout,
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timedelta(seconds=30),
        init_sync=False,  # every replica builds the same model from the same seed
    )
    if args.incarnation == 1:
        _barrier(args.out, r, n, timeout=120)
    kill_at = parse_kills(args.kill).get(r) if args.incarnation == 1 else None
    while manager.current_step() < args.steps:
        if os.path.exists(done_marker):
            break
        manager.start_quorum()
        start = time.time()
        index = manager.current_step()  # a healing replica computes a stale step: its gradient is zeroed
        for p in params:
            p.grad = None
        loss_sum = 0.0
        for k in range(per_rank):
            t = time.perf_counter()
            x, y = source.batch(index, r * per_rank + k)
            loss = model.loss(x, y)
            if kill_at == index and k == 0:
                print(
                    f"[torchft] injecting fault kill:replica={r}:step={index}:phase=backward at t={time.time():.6f}",
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGKILL)
            (loss / per_rank).backward()
            loss_sum += loss.item()
            pad_microbatch(t, args.mb_seconds)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([loss_sum / per_rank], dtype=grads[0].dtype)])
        # AVG over the participants; a non-participant (healing) contributes zeros
        manager.allreduce(flat).wait()
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        participants = manager.num_participants()
        participating = manager.is_participating()
        healing = manager._healing  # healed in this step (its state is applied in should_commit); private in 0.2.0
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        log(
            event="step",
            step=manager.current_step() - 1 if committed else index,
            start=start,
            commit=time.time(),
            committed=committed,
            participants=participants,
            participating=participating,
            healed=healing,
            loss=flat[-1].item() if committed else None,
            live=participants,
            attempt=0,
            incarnation=args.incarnation,
        )
    if manager.current_step() >= args.steps:
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(final, os.path.join(args.out, f"final{r}.pt"))
        open(done_marker, "a").close()
    log(event="end", t=time.time(), step=manager.current_step(), incarnation=args.incarnation, attempt=0)
    # Leave without tearing down gloo/the manager's servers: peers may still be in their last
    # collective or quorum, and destructors of in-flight groups can abort the process.
    os._exit(0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_job_arguments(p)
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--incarnation", type=int, default=1, help="1 = first start (faults fire only then)")
    p.add_argument("--lighthouse", required=True, help="the lighthouse's address, e.g. http://127.0.0.1:PORT")
    p.add_argument("--timeout", type=float, default=10.0, help="Manager / gloo timeout (collectives, commit RPC)")
    p.add_argument("--quorum-timeout", type=float, default=120.0)
    return p


def main() -> None:
    args = parser().parse_args()
    run(args)


if __name__ == "__main__":
    main()
