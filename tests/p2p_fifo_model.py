"""An unbuffered model of NCCL point-to-point, to find hangs on CPU (gloo buffers sends, so a CPU run never hangs).

Each rank's p2p calls are replayed in the order it issued them: a call is one batch (`batch_isend_irecv`: NCCL runs
its ops as one group, so they match in any order) or a single send/recv. A rank works on its oldest unfinished
call; a send completes only together with the matching receive (same pair, same bytes) in the peer's oldest
unfinished call, as a large NCCL send waits for its receive. Stricter than NCCL, which keeps one FIFO per rank
pair: a sequence that completes here completes there.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class P2POp:
    kind: str   # "send" or "recv"
    peer: int   # global rank
    nbytes: int
    done: bool = field(default=False, compare=False)


def find_hang(calls_by_rank: dict[int, list[list[P2POp]]]) -> str | None:
    """None if every rank's calls complete; else what each stuck rank waits on."""
    queues = {rank: [list(call) for call in calls] for rank, calls in calls_by_rank.items()}
    progress = True
    while progress:
        progress = False
        for rank, queue in queues.items():
            while queue and all(op.done for op in queue[0]):
                queue.pop(0)
        for rank, queue in queues.items():
            if not queue:
                continue
            for op in queue[0]:
                if op.done or op.kind != "send":
                    continue
                peer_queue = queues.get(op.peer, [])
                match = next((other for other in (peer_queue[0] if peer_queue else [])
                              if not other.done and other.kind == "recv" and other.peer == rank), None)
                if match is not None:  # the peer's first pending receive from this rank must be this send
                    if match.nbytes != op.nbytes:
                        return f"rank {rank} sends {op.nbytes} B to rank {op.peer}, which receives {match.nbytes} B"
                    op.done = match.done = True
                    progress = True
    stuck = {rank: [(op.kind, op.peer, op.nbytes) for op in queue[0] if not op.done]
             for rank, queue in queues.items() if queue}
    return None if not stuck else f"hang: each rank's first unfinished p2p call waits on {stuck}"


def record_p2p_calls():
    """Record every p2p call this process issues as [P2POp, ...], in issue order: torch's pipeline schedules
    (`schedules._batch_p2p`: a one-kind batch is issued op by op, a mixed one as one group), blocking
    `torch.distributed.send/recv` (megafp8's evaluation receives, torch's stage set-up) and megafp8's `C.isend`.
    Returns (calls, undo)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from megafp8.parallel import collectives as C

    calls: list[list[P2POp]] = []
    originals = [(schedules, "_batch_p2p"), (dist, "send"), (dist, "recv"), (C, "isend")]
    originals = [(module, name, getattr(module, name)) for module, name in originals]
    batch_p2p, send, recv, isend = (original for _, _, original in originals)

    def nbytes(tensor) -> int:
        return tensor.numel() * tensor.element_size()

    def recorded_batch(p2p_ops, desc=None):
        ops = [P2POp("send" if op.op is dist.isend else "recv", op.peer, nbytes(op.tensor)) for op in p2p_ops]
        if len({op.kind for op in ops}) == 1:
            calls.extend([op] for op in ops)
        elif ops:
            calls.append(ops)
        return batch_p2p(p2p_ops, desc)

    def recorded_send(tensor, dst=None, *args, **kwargs):
        calls.append([P2POp("send", dst, nbytes(tensor))])
        return send(tensor, dst, *args, **kwargs)

    def recorded_recv(tensor, src=None, *args, **kwargs):
        calls.append([P2POp("recv", src, nbytes(tensor))])
        return recv(tensor, src, *args, **kwargs)

    def recorded_isend(tensor, dst, *args, **kwargs):
        calls.append([P2POp("send", dst, nbytes(tensor))])
        return isend(tensor, dst, *args, **kwargs)

    schedules._batch_p2p, dist.send, dist.recv, C.isend = recorded_batch, recorded_send, recorded_recv, recorded_isend

    def undo():
        for module, name, original in originals:
            setattr(module, name, original)
    return calls, undo
