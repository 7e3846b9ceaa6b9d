"""A stage's point-to-point traffic as pure data, and a model check of it under NCCL's rules.

What NCCL does with point-to-point operations, and why a plain isend/recv pipeline can hang on it:
  - the operations between two ranks run in the order they were posted, on one stream: a later operation
    starts only when every earlier one of that rank on the communicator has completed;
  - a send of a large tensor completes only when its matching receive is posted (a rendezvous); sends and
    receives between a pair match in posting order (FIFO per direction; tags are ignored);
  - a batch (`torch.distributed.batch_isend_irecv`: ncclGroupStart/End) is posted at once and completes as one.
So a stage that posts `isend(activation j)` and then waits on `recv(gradient k)`, while its neighbour posts
`isend(gradient k)` before the `recv(activation j)` the first is waiting to match, waits forever: 1F1B's
steady state does exactly this (Megatron-LM pairs each exchange, `send_forward_recv_backward`, for this reason).

The rule here (`program`): at every boundary between two compute operations of a stage's schedule
(planner/schedule.py), the sends of what the operation before produced (an activation forward, a gradient
back) and the receives of what the operation after needs are posted together as one batch, which completes
before the next compute operation runs. Every stage derives its batches from the same schedule and the same
peers (planner/layout.py `p2p_peers`: TP fan-out and fan-in between stages of different degree), so the
batches of two neighbours pair up. `check` replays every rank's batches under the rules above and reports a
deadlock (the ranks blocked and the operations each waits on) or a mismatched pair; tests run it over every
schedule, stage count, micro-batch count and TP pattern the planner emits, and over the order the engine used
before (`legacy_program`), which it finds deadlocked. The engine (workers/engine.py) executes `program`.

Pure: no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from planner.layout import p2p_peers, ranks
from planner.plan_types import Plan
from planner.schedule import op_order


@dataclass(frozen=True)
class P2POp:
    """One send or receive of a micro-batch's activation (forward) or activation gradient (backward)."""

    op: Literal["send", "recv"]
    peer: int
    kind: Literal["act", "grad"]
    micro_batch: int

    def __str__(self) -> str:
        arrow = "->" if self.op == "send" else "<-"
        return f"{self.op} {self.kind}[{self.micro_batch}] {arrow} rank {self.peer}"


@dataclass(frozen=True)
class Exchange:
    """One batch of point-to-point operations, posted at once and waited for before `then` runs (None: the
    step's last batch, after the last compute operation)."""

    ops: tuple[P2POp, ...]
    then: tuple[str, int] | None


Item = Exchange | tuple[str, int]  # a batch, or a compute operation ("F" | "B", micro-batch)


def stage_program(ops: list[tuple[str, int]], recv_act: int | None, send_act: list[int],
                  recv_grad: int | None, send_grad: list[int]) -> list[Item]:
    """A stage's step: its compute operations with a batch at each boundary (empty batches left out)."""
    out: list[Item] = []
    before: tuple[str, int] | None = None
    for op in [*ops, None]:
        batch: list[P2POp] = []
        if before is not None:  # what the operation before produced
            kind, j = before
            if kind == "F":
                batch += [P2POp("send", d, "act", j) for d in send_act]
            else:
                batch += [P2POp("send", d, "grad", j) for d in send_grad]
        if op is not None:  # what the operation after needs
            kind, j = op
            if kind == "F" and recv_act is not None:
                batch.append(P2POp("recv", recv_act, "act", j))
            elif kind == "B" and recv_grad is not None:
                batch.append(P2POp("recv", recv_grad, "grad", j))
        if batch:
            out.append(Exchange(tuple(batch), op))
        if op is not None:
            out.append(op)
        before = op
    return out


def program(plan: Plan, rank: int) -> list[Item]:
    """Rank `rank`'s step under `plan`: compute operations and the batches between them."""
    info = ranks(plan)[rank]
    pipe = plan.pipelines[info.pipeline]
    ops = op_order(info.stage, len(pipe.stages), pipe.num_micro_batches, pipe.schedule)
    return stage_program(ops, *p2p_peers(plan, info.pipeline, info.stage, info.tp_rank))


def eval_program(plan: Plan, rank: int) -> list[Item]:
    """Rank `rank`'s forward-only pass of one global batch (a validation loss): every micro-batch's forward in
    order, each boundary's send of the last activation posted with the receive of the next (deadlock-free by
    `check`: tests/test_p2p.py)."""
    info = ranks(plan)[rank]
    pipe = plan.pipelines[info.pipeline]
    recv_act, send_act, _, _ = p2p_peers(plan, info.pipeline, info.stage, info.tp_rank)
    return stage_program([("F", j) for j in range(pipe.num_micro_batches)], recv_act, send_act, None, [])


def legacy_program(plan: Plan, rank: int) -> list[Item]:
    """The order the engine posted before batching: after a forward, one `isend` per activation (not waited);
    before a forward or backward, a blocking `recv`; after a backward, one `isend` per gradient. Under NCCL an
    isend still occupies the pair's stream until matched, so each operation is a batch of its own."""
    info = ranks(plan)[rank]
    pipe = plan.pipelines[info.pipeline]
    recv_act, send_act, recv_grad, send_grad = p2p_peers(plan, info.pipeline, info.stage, info.tp_rank)
    out: list[Item] = []
    for kind, j in op_order(info.stage, len(pipe.stages), pipe.num_micro_batches, pipe.schedule):
        if kind == "F":
            if recv_act is not None:
                out.append(Exchange((P2POp("recv", recv_act, "act", j),), (kind, j)))
            out.append((kind, j))
            out += [Exchange((P2POp("send", d, "act", j),), None) for d in send_act]
        else:
            if recv_grad is not None:
                out.append(Exchange((P2POp("recv", recv_grad, "grad", j),), (kind, j)))
            out.append((kind, j))
            out += [Exchange((P2POp("send", d, "grad", j),), None) for d in send_grad]
    return out


@dataclass(frozen=True)
class Finding:
    """What `check` found: a deadlock (the blocked ranks and what each waits on) or a mismatched pair."""

    kind: Literal["deadlock", "mismatch"]
    detail: str
    blocked: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (rank, its batch's unmatched operations)

    def __str__(self) -> str:
        lines = [f"{self.kind}: {self.detail}"]
        lines += [f"  rank {r} waits on: {'; '.join(ops)}" for r, ops in self.blocked]
        return "\n".join(lines)


def check(programs: dict[int, list[Item]]) -> Finding | None:
    """Replay every rank's batches under NCCL's rules (module docstring); None if every batch completes.

    Each rank posts its next batch once its previous one has completed (one stream: later operations wait
    for earlier ones). The i-th send from a to b matches the i-th receive at b from a, once both are posted;
    a batch completes when all its operations have matched. A matched pair that moves a different tensor
    (kind or micro-batch) is a mismatch: NCCL would deliver the wrong bytes or hang on the size."""
    batches = {r: [it.ops for it in prog if isinstance(it, Exchange)] for r, prog in programs.items()}
    at = dict.fromkeys(batches, 0)  # each rank's batch being posted
    left: dict[int, set[int]] = {}  # unmatched operation indices of each rank's posted batch
    sends: dict[tuple[int, int], deque] = {}  # (src, dst) -> posted, unmatched sends: (op index, P2POp)
    recvs: dict[tuple[int, int], deque] = {}  # (src, dst) -> posted, unmatched receives at dst
    ready = deque(r for r in batches if batches[r])

    def post(r: int) -> None:
        ops = batches[r][at[r]]
        left[r] = set(range(len(ops)))
        for i, op in enumerate(ops):
            key = (r, op.peer) if op.op == "send" else (op.peer, r)
            (sends if op.op == "send" else recvs).setdefault(key, deque()).append((r, i, op))

    for r in ready:
        post(r)
    progress = True
    while progress:
        progress = False
        for key in list(sends):
            s_q, r_q = sends[key], recvs.get(key, deque())
            while s_q and r_q:
                (src, i, s_op), (dst, k, r_op) = s_q.popleft(), r_q.popleft()
                if (s_op.kind, s_op.micro_batch) != (r_op.kind, r_op.micro_batch):
                    return Finding("mismatch", f"rank {src}'s '{s_op}' met rank {dst}'s '{r_op}'")
                left[src].discard(i)
                left[dst].discard(k)
                progress = True
        for r in list(left):
            if not left[r]:
                del left[r]
                at[r] += 1
                if at[r] < len(batches[r]):
                    post(r)
                progress = True
    if left:  # (a batch completes only when all its operations matched: with none left, nothing is unmatched)
        blocked = tuple((r, tuple(str(batches[r][at[r]][i]) for i in sorted(left[r]))) for r in sorted(left))
        return Finding("deadlock", f"{len(left)} rank(s) wait forever on batches no peer can complete", blocked)
    return None


def check_plan(plan: Plan, order: Callable[[Plan, int], list[Item]] = program) -> Finding | None:
    """`check` over every rank of `plan`, with each rank's batches from `order` (`program` or `legacy_program`)."""
    return check({r.rank: order(plan, r.rank) for r in ranks(plan)})
