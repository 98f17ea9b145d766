"""Resharding: the trainer's weights into the rollout engine's layout, in place, every update.

The trainer keeps each HF-named parameter as an FSDP2 shard (dim 0 split over the W ranks of
the default process group, `torch.chunk` sizes) or whole (no FSDP). The native engine on each
rank keeps its tensor-parallel piece of each, as `NativeCausalLM.place` says: a row or column
range of the full tensor landing at a row offset of one of its parameters (fused qkv and
gate_up), or a zero-fill (a row-parallel bias off TP rank 0).

Plan once (`Resharder.__init__`): every rank states what it needs (one `all_gather_object`), and
every rank derives the same blocks (source rank, destination rank, parameter, rows, columns) and
the same buckets of consecutive parameters. Each switch (`sync`), bucket by bucket, in the same
order on every rank:

    send = my rows of every block I source, cut to its columns, cast to the rollout dtype,
           grouped by destination rank
    all_to_all_single(recv, send)      # the only communication, asynchronous
    copy each received block into its place in the rollout's parameters

Rows a rank needs from its own shard skip the buffers: they are copied into place while the
bucket's collective runs. A bucket's copies wait for its collective while the next bucket packs
and starts its own, so packing overlaps communication. No rank ever holds more than two buckets
beyond its own shard and its own rollout piece. With t = 1 every rank needs every weight, and the
all_to_all moves what an all-gather would (the floor).

The blocks are bound to views of the tensors they read and write once, and again only when one
of those tensors moved, so a switch is a few batched copies per bucket (`torch._foreach_copy_`),
not a few tensor ops per block on the host.

Invariant: after `sync`, the rollout's parameters equal bit for bit what `load_weights` of the
full tensors writes (the same cast, the same cuts). An fp8 rollout (`rollout.dtype=fp8`) takes
its weights in bf16 like a bf16 one and quantises each block's rows where they land, scales and
all: a row's quantisation reads that row alone (engine/rollout/fp8.py), so blocks agree with
`load_weights` bit for bit too.

Split placement (`placement.own_pool=[rollout]`): the rollout engines live in their own pool, whose
processes share no default group with the trainer's. `WeightBroadcast` is a stand-alone group of
trainer rank 0 (group rank 0) and every rollout rank (1..W), built from a TCPStore that trainer
rank 0 hosts (gloo on CPU, NCCL on CUDA). Both sides cut the trainer's HF-named parameters, in
`named_parameters` order, into the same buckets (`buckets_of`), and each push (`push_weights` on
every trainer rank, `WeightBroadcast.receive` on every rollout rank, together) runs:

    broadcast(version)                                   # an int64, first
    for bucket in buckets:
        trainer ranks: all-gather each FSDP2 parameter in turn (`full_tensors`)
        trainer rank 0: pack the bucket, cast to the rollout dtype; broadcast(bucket)
        rollout ranks: broadcast(buffer); engine.load_weights(views of the buffer)

Invariant: after a push every rollout rank's engine holds bit for bit what
`load_weights(full_tensors(trainer))` writes, and reports the version that came with it.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlflow.engine.rollout import fp8
from rlflow.engine.rollout.model import Cut, NativeCausalLM
from rlflow.engine.tensors import tcp_store
from rlflow.engine.train import lora

BUCKET_BYTES = 256 * 2**20  # of rollout-dtype weights per all_to_all


@dataclass(frozen=True)
class Block:
    """Rows `rows` (and columns `cols`, None = all) of trainer parameter `name`, sent from rank
    `src` to rank `dst`, landing on rollout parameter `target` from row `row` on."""
    src: int
    dst: int
    name: str
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    target: str
    row: int

    def numel(self, shape: torch.Size) -> int:
        width = (self.cols[1] - self.cols[0]) if self.cols else int(torch.Size(shape[1:]).numel())
        return (self.rows[1] - self.rows[0]) * width


def owned_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """The rows of an n-row tensor FSDP2 keeps on `rank` (torch.chunk's split, empty at the end)."""
    chunk = -(-n // world)
    return min(n, rank * chunk), min(n, (rank + 1) * chunk)


def blocks_for(name: str, shape: torch.Size, target: str, cut: Cut, dst: int, world: int,
               sharded: bool) -> list[Block]:
    """The blocks rank `dst` receives for its cut of `name`: one per source rank holding needed rows."""
    rows = (cut.start, cut.start + cut.length) if cut.dim == 0 else (0, shape[0])
    cols = (cut.start, cut.start + cut.length) if cut.dim == 1 else None
    out = []
    for src in (range(world) if sharded else [dst]):  # whole tensors: every rank has its own copy
        lo, hi = owned_rows(shape[0], world, src) if sharded else (0, shape[0])
        a, b = max(rows[0], lo), min(rows[1], hi)
        if a < b:
            out.append(Block(src, dst, name, (a, b), cols, target, cut.row + a - rows[0]))
    return out


class Resharder:
    """Moves a (possibly FSDP2-sharded) HF causal LM's weights into a NativeCausalLM on every
    rank of the default process group; all ranks construct it and call `sync` together."""

    def __init__(self, trainer: torch.nn.Module, rollout: NativeCausalLM, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.dist = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if self.dist else (0, 1)
        self.rollout = rollout
        self.source = dict(trainer.named_parameters())
        self.target = dict(rollout.named_parameters())
        self.dtype = rollout.model.embed_tokens.weight.dtype  # what travels: bf16 to an fp8 rollout too
        self.device = next(iter(self.source.values())).device
        mine = {name: rollout.place(name, p.shape) for name, p in self.source.items()}
        needs = [mine]
        if self.dist:
            needs = [{} for _ in range(self.world)]
            dist.all_gather_object(needs, mine)
        self.zeros = [v[0] for v in mine.values() if v and v[1].zero]  # filled here, nothing sent
        self.buckets = self._plan(needs, bucket_bytes)
        self.moves = [self._arrange(bucket) for bucket in self.buckets]  # per switch, only the copies and collectives
        self._key: list[int] = []  # the addresses `_bound`'s views were made at
        self._bound: list[BucketViews] = []
        mine_in = [b for bucket in self.buckets for b in bucket if b.dst == self.rank]
        self.bytes_received = sum(b.numel(self.source[b.name].shape) for b in mine_in) * self.dtype.itemsize
        self.bytes_from_peers = sum(b.numel(self.source[b.name].shape) for b in mine_in
                                    if b.src != self.rank) * self.dtype.itemsize  # what crosses a link

    def _plan(self, needs: list[dict[str, tuple[str, Cut] | None]], bucket_bytes: int) -> list[list[Block]]:
        """Blocks of consecutive parameters, in the buckets `buckets_of` cuts."""
        shapes = [(name, list(p.shape)) for name, p in self.source.items()]
        buckets = [[b for name, shape in bucket for dst, need in enumerate(needs)
                    if (placed := need[name]) is not None and not placed[1].zero
                    for b in blocks_for(name, torch.Size(shape), placed[0], placed[1], dst, self.world,
                                        isinstance(self.source[name], DTensor))]
                   for bucket in buckets_of(shapes, self.dtype.itemsize, bucket_bytes)]
        return [b for b in buckets if b]

    @torch.no_grad()
    def sync(self) -> None:
        """Every rank, together: the rollout's weights become the trainer's (mapped again first
        if the engine released them, at the addresses the views were bound to)."""
        self.rollout.writing_weights()
        for target in self.zeros:
            self.target[target].zero_()
        flying = None  # the previous bucket: its copies in wait for its collective, while this one's packs
        for views in self._views():
            sent = self._send(views)
            write_all(views.own_dst, views.own_src, views.own_scales)  # rows this rank keeps: from its shard into place
            if flying:
                self._receive(*flying)
            flying = (views, *sent)
        if flying:
            self._receive(*flying)

    __call__ = sync  # a Resharder is the pipeline's weight sync (`weight_sync`)

    def _arrange(self, bucket: list[Block]) -> tuple[list[Block], list[Block], list[Block], list[int], list[int]]:
        """This rank's part of a bucket: the blocks it sends to peers (by destination), receives
        from peers (by source) and keeps (its own rows it needs), in plan order within each
        rank, and the element counts per peer."""
        out = sorted((b for b in bucket if b.src == self.rank != b.dst), key=lambda b: b.dst)  # stable: plan order
        inc = sorted((b for b in bucket if b.dst == self.rank != b.src), key=lambda b: b.src)
        own = [b for b in bucket if b.src == b.dst == self.rank]
        return out, inc, own, self._splits(out, "dst"), self._splits(inc, "src")

    def _views(self) -> list[BucketViews]:
        """Every bucket's blocks as views of the tensors they read and write, made once and made
        again only when a tensor under them moved (FSDP2's lazy init can swap a shard's storage):
        a switch then runs a few batched copies per bucket, not a few tensor ops per block."""
        key = [t.data_ptr() for t in self._anchors()]
        if key != self._key:
            self._bound = [BucketViews([self._source_rows(b) for b in out], [self._target_rows(b) for b in inc],
                                       [self._target_rows(b) for b in own], [self._source_rows(b) for b in own],
                                       out_splits, in_splits, [self._scale_rows(b) for b in inc],
                                       [self._scale_rows(b) for b in own])
                           for out, inc, own, out_splits, in_splits in self.moves]
            self._key = key
        return self._bound

    def _anchors(self) -> list[torch.Tensor]:
        """The tensors the views lie in: this rank's shard of every source, every target."""
        return [*(local(p) for p in self.source.values()), *self.target.values()]

    def _send(self, views: BucketViews) -> tuple[torch.Tensor, Any]:
        """Pack this rank's outgoing blocks and start the bucket's all_to_all; (receive buffer, work)."""
        send = torch.empty(sum(views.out_splits), dtype=self.dtype, device=self.device)
        copy_all(split_like(send, views.out_src), views.out_src)
        if not self.dist:
            return send, None
        recv = torch.empty(sum(views.in_splits), dtype=self.dtype, device=self.device)
        return recv, dist.all_to_all_single(recv, send, views.in_splits, views.out_splits, async_op=True)

    def _receive(self, views: BucketViews, recv: torch.Tensor, work: Any) -> None:
        """Wait for a bucket's all_to_all and copy each received block into its place."""
        if work is not None:
            work.wait()
        write_all(views.inc_dst, split_like(recv, views.inc_dst), views.inc_scales)

    def _target_rows(self, b: Block) -> torch.Tensor:
        """Where block `b` lands: its rows of the rollout's parameter."""
        return self.target[b.target].narrow(0, b.row, b.rows[1] - b.rows[0])

    def _scale_rows(self, b: Block) -> torch.Tensor | None:
        """The scales of block `b`'s rows where it lands in an fp8 weight; None for any other parameter."""
        scale = self.target.get(b.target + "_scale")
        return None if scale is None else scale.narrow(0, b.row, b.rows[1] - b.rows[0])

    def _source_rows(self, b: Block) -> torch.Tensor:
        """This rank's rows (and columns) of block `b`, a view of its shard."""
        p = self.source[b.name]
        lo = owned_rows(p.shape[0], self.world, self.rank)[0] if isinstance(p, DTensor) else 0
        piece = local(p)[b.rows[0] - lo:b.rows[1] - lo]
        return piece[:, b.cols[0]:b.cols[1]] if b.cols else piece

    def _splits(self, blocks: list[Block], key: str) -> list[int]:
        sizes = [0] * self.world
        for b in blocks:
            sizes[getattr(b, key)] += b.numel(self.source[b.name].shape)
        return sizes


@dataclass
class BucketViews:
    """One bucket's work on this rank, as views: what it sends (in send order), where what it
    receives lands (in receive order), where its own rows land and where they come from, the
    element counts per peer of its all_to_all, and, beside each landing place in an fp8 weight,
    its rows' scales (None elsewhere)."""
    out_src: list[torch.Tensor]
    inc_dst: list[torch.Tensor]
    own_dst: list[torch.Tensor]
    own_src: list[torch.Tensor]
    out_splits: list[int]
    in_splits: list[int]
    inc_scales: list[torch.Tensor | None]
    own_scales: list[torch.Tensor | None]


def local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: its FSDP2 shard, or the whole tensor."""
    return p.to_local() if isinstance(p, DTensor) else p.detach()


def split_like(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut into consecutive views shaped as the tensors of `like`."""
    parts = flat.split([t.numel() for t in like])
    return [part.view(t.shape) for part, t in zip(parts, like)]


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i] = src[i] (cast to dst's dtype), in one batched call."""
    if dst:
        torch._foreach_copy_(dst, src)


def write_all(dst: list[torch.Tensor], src: list[torch.Tensor], scales: list[torch.Tensor | None]) -> None:
    """dst[i] = src[i]: cast (`copy_all`), or quantised into fp8 rows with their scales where scales[i] is set."""
    if not any(s is not None for s in scales):
        copy_all(dst, src)
        return
    copy_all([d for d, s in zip(dst, scales) if s is None], [x for x, s in zip(src, scales) if s is None])
    for d, x, s in zip(dst, src, scales):
        if s is not None:
            fp8.quantize_into(d, s, x)


def weight_sync(trainer: torch.nn.Module, rollout: Any) -> Resharder | FullSync:
    """The one way the pipeline refreshes a rollout engine from the trainer (all ranks call it
    together): planned resharding for the native engine, full tensors for any other backend and
    for a LoRA trainer (merged weights, which the trainer never holds as parameters)."""
    model = getattr(rollout, "model", None)
    if isinstance(model, NativeCausalLM) and not lora.has_adapters(trainer):
        return Resharder(trainer, model)
    return FullSync(trainer, rollout)


class FullSync:
    """Every full tensor of `full_tensors` into the engine's `load_weights`; `bytes_received` is
    what one sync hands the engine, in the rollout's dtype (as a Resharder's)."""

    def __init__(self, trainer: torch.nn.Module, rollout: Any) -> None:
        self.trainer, self.rollout = trainer, rollout
        dtype = next(rollout.model.parameters()).dtype
        self.bytes_received = sum(torch.Size(s).numel() for _, s in lora.merged_shapes(trainer)) * dtype.itemsize
        self.bytes_from_peers = 0  # every rank gathers the full tensors itself

    def __call__(self) -> None:
        self.rollout.load_weights(full_tensors(self.trainer))


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor: an FSDP2 shard all-gathered (collective), else itself."""
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def full_tensors(trainer: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of every weight of the trainer's model, one at a time: an FSDP2 shard
    is all-gathered when its turn comes (every rank must iterate in step). With LoRA adapters,
    those of the merged model (`lora.merged`)."""
    if lora.has_adapters(trainer):
        yield from lora.merged(trainer, full)
        return
    for name, p in trainer.named_parameters():
        yield name, full(p)


def weight_shapes(trainer: torch.nn.Module) -> list[tuple[str, list[int]]]:
    """(name, full shape) of every tensor a push sends (`push_tensors`), in its order: the plan of a push."""
    return [(name, list(p.shape)) for name, p in trainer.named_parameters()
            if not lora.has_adapters(trainer) or ".lora_" in name]


def push_tensors(trainer: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What a push to a rollout pool sends: every weight (`full_tensors`), or with LoRA the adapters
    alone, which the pool merges into its engine beside its own copy of the base (`lora.Merger`)."""
    return lora.adapter_tensors(trainer, full) if lora.has_adapters(trainer) else full_tensors(trainer)


def buckets_of(shapes: list[tuple[str, list[int]]], itemsize: int,
               bucket_bytes: int) -> list[list[tuple[str, list[int]]]]:
    """Consecutive parameters in buckets of at most `bucket_bytes` (a lone bigger tensor gets its own)."""
    buckets: list[list[tuple[str, list[int]]]] = [[]]
    size = 0
    for name, shape in shapes:
        full = torch.Size(shape).numel() * itemsize
        if size and size + full > bucket_bytes:
            buckets.append([])
            size = 0
        size += full
        buckets[-1].append((name, shape))
    return [b for b in buckets if b]


def _group(store: Any, rank: int, size: int, device: torch.device, timeout: datetime.timedelta) -> Any:
    """A process group over `store` alone, outside torch.distributed's registry: gloo on CPU, NCCL
    on CUDA (on this process's current device, the GPU Ray assigned it)."""
    if device.type != "cuda":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    nccl: Any = dist.ProcessGroupNCCL  # absent from CPU builds of torch
    return nccl(store, rank, size, nccl.Options())


PLAN_KEY = "rollout-weights/plan"  # the store's key of the push plan: the parameters' names and shapes


class WeightBroadcast:
    """One end of the trainer -> rollout-pool weight group: `rank` 0 is trainer rank 0 (it hosts
    the store at host:port and sends), ranks 1..size-1 are the rollout ranks (they receive). All
    `size` ends construct it together, rank 0 with the push plan (`weight_shapes` of the trainer),
    which the others read from the store (`shapes`); then every push is `send` on rank 0 (inside
    `push_weights`) and `receive` on the others, together."""

    def __init__(self, host: str, port: int, rank: int, size: int, shapes: list[tuple[str, list[int]]] | None,
                 dtype: torch.dtype, device: torch.device, bucket_bytes: int = BUCKET_BYTES,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> None:
        self.store = tcp_store(host, port, size, rank, timeout)
        if rank == 0:
            assert shapes is not None, "the sender has the plan"
            self.store.set(PLAN_KEY, json.dumps(shapes))
        else:  # waits, within the store's timeout, for the sender's plan
            shapes = [(name, list(shape)) for name, shape in json.loads(self.store.get(PLAN_KEY))]
        self.shapes: list[tuple[str, list[int]]] = shapes
        if any(".lora_" in name for name, _ in shapes):
            dtype = torch.float32  # LoRA adapters, few and merged on arrival: sent at the trainer's precision
        self.rank, self.dtype, self.device = rank, dtype, device
        self.buckets = buckets_of(shapes, dtype.itemsize, bucket_bytes)
        self.bytes_per_push = sum(torch.Size(s).numel() for _, s in shapes) * dtype.itemsize
        # A group of its own: each pool already has its default group, and dist.new_group cannot span two.
        store = dist.PrefixStore("rollout-weights", self.store)
        self.group = _group(store, rank, size, device, timeout)

    def _buffer(self, bucket: list[tuple[str, list[int]]]) -> torch.Tensor:
        return torch.empty(sum(torch.Size(s).numel() for _, s in bucket), dtype=self.dtype, device=self.device)

    def _broadcast(self, t: torch.Tensor) -> None:
        self.group.broadcast([t], dist.BroadcastOptions()).wait()  # root 0: trainer rank 0

    @torch.no_grad()
    def send(self, tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        """Rank 0: broadcast `version`, then `tensors` (the trainer's, in plan order) bucket by bucket."""
        self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
        for bucket in self.buckets:
            buffer = self._buffer(bucket)
            at = 0
            for name, shape in bucket:
                got, tensor = next(tensors)
                assert got == name, f"trainer parameter {got} where the plan has {name}"
                n = tensor.numel()
                buffer[at:at + n].view(shape).copy_(tensor)  # the cast load_weights would make
                at += n
            self._broadcast(buffer)

    @torch.no_grad()
    def receive(self, load: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> int:
        """A rollout rank: the trainer's weights, bucket by bucket, each handed to `load` (an engine's
        `load_weights`) as (name, tensor) views of a buffer of its own; their version."""
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(version)
        for bucket in self.buckets:
            buffer = self._buffer(bucket)
            self._broadcast(buffer)
            views, at = [], 0
            for name, shape in bucket:
                n = torch.Size(shape).numel()
                views.append((name, buffer[at:at + n].view(shape)))
                at += n
            load(views)
        return int(version.item())


def push_weights(trainer: torch.nn.Module, link: WeightBroadcast | None, version: int) -> None:
    """Every trainer rank, together with every rollout rank's `receive`: the full tensors are
    all-gathered on every trainer rank, and rank 0 (the one holding `link`) sends them."""
    tensors = push_tensors(trainer)
    if link is None:
        for _ in tensors:  # join each all-gather
            pass
    else:
        link.send(tensors, version)
