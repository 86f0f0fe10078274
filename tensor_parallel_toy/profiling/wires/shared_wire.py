"""The modeled wire's bytes: shared memory between the ranks of one host, moved at memory speed.

Over gloo, even on loopback, a transfer costs the rank that posts it CPU time: gloo writes the
bytes into a TCP socket on the posting thread and the kernel copies them twice. Measured here,
a 5 ms modeled transfer cost each rank 1.4 ms of CPU, more than the ring's pieces could hide.
A copy engine or a NIC costs the compute cores nothing. This module moves the bytes of every
transfer the modeled wire (wire.py) carries through one shared file instead, one copy in at post
and one copy out at the wait, about 25 us for 512 KiB here, so the host's time is the GEMMs and
the modeled wire's sleep, and what an overlapped op takes is what its schedule allows.

Layout: for each ordered pair of ranks (src, dst) a byte stream, a ring buffer of `capacity`
bytes in the shared file with two counters, `head` (bytes src has written, only src stores it)
and `tail` (bytes dst has read, only dst stores it). A message is a 24-byte header (a magic
number, its length, a tag of its kind of call and its group's ranks) and its payload; each end
matches messages in the order it posted them, as every rank posts the transfers of one group in
the same order (the profile runs the wire on one TP group: `--dp 1`). A message larger than
what is free is written as the reader frees space: any rank waiting on any transfer moves every
stream it can, so two ranks sending to each other never wait on each other.

What a call does with the streams:
- P2P (one ring step): the send is one message, the receive one message;
- all_gather: the shard to every other rank, each rank's shard into its place;
- reduce_scatter: chunk j to rank j; chunk r of every rank summed in rank order;
- all_reduce: the tensor to every other rank; all of them reduced in rank order, so every rank
  computes bitwise the same result;
- broadcast: the source's tensor to every other rank.
These move more bytes than a ring would (p - 1 copies of a tensor where a ring sends (p - 1)/p
of it), at memory speed; the wire's time is charged by wire.py at ring cost.

Safe by construction: a header that does not match what the receiver expects (another length,
another call) raises at once, naming both; a wait that sees no progress for WAIT_LIMIT_S raises
rather than hangs. The shared file is unlinked as soon as every rank has mapped it, so nothing
is left behind, also after a kill. The ring buffers' counters rely on the CPU making a store
visible after the stores before it (x86's ordering), as the machines here do.
"""
import contextlib
import ctypes
import functools
import mmap
import os
import secrets
import tempfile
import time
import zlib

import torch
import torch.distributed as dist

CAPACITY = 4 << 20  # bytes per stream: the profile's largest transfer (1 MiB) fits whole
WAIT_LIMIT_S = 300.0  # no progress for this long: raise, naming the transfer
_MAGIC = 0x7e7017  # the first word of every header
_HEADER = 3  # int64 words: magic, payload bytes, tag
_LINE = 8  # int64 words per counter: one 64-byte cache line each


class _Piece:
    """Bytes to move between the ring and a buffer at `address` (kept alive by `owner`)."""

    def __init__(self, owner, address, nbytes, on_done=None):
        self.owner, self.address, self.nbytes, self.on_done = owner, address, nbytes, on_done
        self.done = 0


def _tensor_piece(t, on_done=None):
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("the modeled wire moves contiguous CPU tensors")
    return _Piece(t, t.data_ptr(), t.numel() * t.element_size(), on_done)


class _Stream:
    """One end of the byte stream src -> dst: a ring buffer at `base`, `capacity` bytes."""

    def __init__(self, base, capacity, counters, head, tail):
        self.base, self.capacity, self.counters = base, capacity, counters
        self.head, self.tail = head * _LINE, tail * _LINE  # counters: the file's int64 words
        self.queue = []  # _Pieces, in the order they were posted

    def move(self, writing):
        """Move what the stream allows now; True if anything moved."""
        moved = False
        while self.queue:
            piece = self.queue[0]
            written, read = self.counters[self.head], self.counters[self.tail]
            room = (self.capacity - (written - read)) if writing else (written - read)
            n = min(room, piece.nbytes - piece.done)
            if n <= 0 and piece.done < piece.nbytes:
                return moved
            at = written if writing else read
            start = at % self.capacity
            first = min(n, self.capacity - start)  # up to the ring's end, the rest from its start
            for ring, buf, k in ((self.base + start, piece.address + piece.done, first),
                                 (self.base, piece.address + piece.done + first, n - first)):
                if k:
                    ctypes.memmove(ring, buf, k) if writing else ctypes.memmove(buf, ring, k)
            self.counters[self.head if writing else self.tail] = at + n
            piece.done += n
            moved = True
            if piece.done == piece.nbytes:
                self.queue.pop(0)
                if piece.on_done is not None:
                    piece.on_done()
        return moved


class Transfer:
    """A posted call: its messages, and what to do once they are all through (`finish`)."""

    def __init__(self, wire, what, finish=None):
        self.wire, self.what, self.finish = wire, what, finish
        self.left = 0

    def _one_done(self):
        self.left -= 1

    def wait(self):
        deadline = time.monotonic() + WAIT_LIMIT_S
        while self.left:
            if self.wire.move_all():
                deadline = time.monotonic() + WAIT_LIMIT_S
            elif time.monotonic() > deadline:
                raise RuntimeError(f"modeled wire: rank {self.wire.rank} saw no progress for "
                                   f"{WAIT_LIMIT_S:.0f} s waiting for {self.what}: a peer "
                                   f"stopped or called another transfer")
            else:
                time.sleep(20e-6)
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return True


class SharedWire:
    """The streams between this rank and every other rank of the world, and the calls that
    the package's transfers make (torch.distributed's signatures) carried over them."""

    def __init__(self, mapped, world, rank, capacity):
        self.world, self.rank = world, rank
        head_bytes = 2 * world * world * _LINE * 8
        self.mapped = mapped
        counters = memoryview(mapped)[:head_bytes].cast("q")
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapped)) + head_bytes

        def stream(src, dst):
            pair = src * world + dst
            return _Stream(base + pair * capacity, capacity, counters, 2 * pair, 2 * pair + 1)

        self.out = {dst: stream(rank, dst) for dst in range(world) if dst != rank}
        self.into = {src: stream(src, rank) for src in range(world) if src != rank}

    @staticmethod
    def file_bytes(world, capacity):
        return 2 * world * world * _LINE * 8 + world * world * capacity

    def move_all(self):
        moved = False
        for s in self.out.values():
            moved |= s.move(writing=True)
        for s in self.into.values():
            moved |= s.move(writing=False)
        return moved

    # -- messages ----------------------------------------------------------------------------
    def _send(self, transfer, dst, tensor, tag):
        payload = _tensor_piece(tensor.contiguous(), transfer._one_done)
        header = (ctypes.c_int64 * _HEADER)(_MAGIC, payload.nbytes, tag)
        transfer.left += 1
        self.out[dst].queue += [_Piece(header, ctypes.addressof(header), ctypes.sizeof(header)),
                                payload]

    def _recv(self, transfer, src, into, tag):
        """Receive into `into` (contiguous) a message that must have its size and `tag`."""
        payload = _tensor_piece(into, transfer._one_done)
        header = (ctypes.c_int64 * _HEADER)()
        expected = (_MAGIC, payload.nbytes, tag)

        def check():
            got = tuple(header)
            if got != expected:
                raise RuntimeError(
                    f"modeled wire: rank {self.rank} expected from rank {src} "
                    f"{expected[1]} bytes of {_TAG_NAMES.get(expected[2] & 0xff, '?')}, got "
                    f"{got[1]} bytes of {_TAG_NAMES.get(got[2] & 0xff, '?')}: the ranks posted "
                    f"their transfers in a different order")
        transfer.left += 1
        self.into[src].queue += [_Piece(header, ctypes.addressof(header), ctypes.sizeof(header),
                                        check), payload]

    def _start(self, transfer):
        self.move_all()  # the sends' bytes go in now, at the post
        return transfer

    # -- the calls ---------------------------------------------------------------------------
    def ring_step(self, ops):
        """batch_isend_irecv: sends and receives to and from global ranks."""
        transfer = Transfer(self, "a ring step")
        landing = []
        for op in ops:
            if op.op is dist.isend:
                self._send(transfer, op.peer, op.tensor, _tag("p2p", op.group))
            else:
                into = op.tensor if op.tensor.is_contiguous() else torch.empty_like(
                    op.tensor, memory_format=torch.contiguous_format)
                landing.append((op.tensor, into))
                self._recv(transfer, op.peer, into, _tag("p2p", op.group))
        transfer.finish = lambda: [t.copy_(into) for t, into in landing if t is not into]
        return self._start(transfer)

    def all_gather_parts(self, parts, tensor, group):
        """Rank i's `tensor` into parts[i] on every rank (parts contiguous)."""
        ranks, r = _ranks(group)
        transfer = Transfer(self, "an all-gather")
        for i, g in enumerate(ranks):
            if i != r:
                self._send(transfer, g, tensor, _tag("all_gather", group))
                self._recv(transfer, g, parts[i], _tag("all_gather", group))
        parts[r].copy_(tensor)
        return self._start(transfer)

    def reduce_scatter(self, output, tensor, op, group):
        ranks, r = _ranks(group)
        chunks = tensor.contiguous().chunk(len(ranks))
        received = {}
        transfer = Transfer(self, "a reduce-scatter")
        for i, g in enumerate(ranks):
            if i != r:
                self._send(transfer, g, chunks[i], _tag("reduce_scatter", group))
                received[i] = torch.empty_like(chunks[r])
                self._recv(transfer, g, received[i], _tag("reduce_scatter", group))
        own = chunks[r].clone()  # the caller may write its input once the call returns
        transfer.finish = lambda: output.copy_(
            _reduce([received.get(i, own) for i in range(len(ranks))], op))
        return self._start(transfer)

    def all_reduce(self, tensor, op, group):
        ranks, r = _ranks(group)
        received = {}
        transfer = Transfer(self, "an all-reduce")
        for i, g in enumerate(ranks):
            if i != r:
                self._send(transfer, g, tensor, _tag("all_reduce", group))
                received[i] = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                self._recv(transfer, g, received[i], _tag("all_reduce", group))
        own = tensor.clone()
        transfer.finish = lambda: tensor.copy_(
            _reduce([received.get(i, own) for i in range(len(ranks))], op))
        return self._start(transfer)

    def broadcast(self, tensor, src, group):
        ranks, r = _ranks(group)
        transfer = Transfer(self, "a broadcast")
        if self.rank == src:
            for g in ranks:
                if g != src:
                    self._send(transfer, g, tensor, _tag("broadcast", group))
        else:
            into = tensor if tensor.is_contiguous() else torch.empty_like(
                tensor, memory_format=torch.contiguous_format)
            self._recv(transfer, src, into, _tag("broadcast", group))
            if into is not tensor:
                transfer.finish = lambda: tensor.copy_(into)
        return self._start(transfer)


_TAG = {"p2p": 1, "all_gather": 2, "reduce_scatter": 3, "all_reduce": 4, "broadcast": 5}
_TAG_NAMES = {v: k.replace("_", "-") for k, v in _TAG.items()}
_REDUCE = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum,
           dist.ReduceOp.MIN: torch.minimum, dist.ReduceOp.PRODUCT: torch.mul}


@functools.lru_cache(maxsize=None)
def _tag(kind, group):
    """The call's kind and its group's ranks, so that a message is never taken for another's
    (once per kind and group: it is asked for on every message)."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return _TAG[kind] | zlib.crc32(repr(ranks).encode()) << 8


def _reduce(tensors, op):
    """Every rank's tensor reduced in rank order: the same bits on every rank."""
    if op not in _REDUCE:
        raise ValueError(f"modeled wire: reduce op {op} is not one of SUM, MAX, MIN, PRODUCT")
    acc = tensors[0].clone()
    for t in tensors[1:]:
        _REDUCE[op](acc, t, out=acc)
    return acc


def _ranks(group):
    """(the group's global ranks, this rank's index among them)."""
    group = group or dist.group.WORLD
    return dist.get_process_group_ranks(group), dist.get_rank(group)


def _map(path, size, create):
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


@contextlib.contextmanager
def shared_wire(capacity=CAPACITY):
    """Inside, a SharedWire between every rank of the default group (collective: every rank
    enters it). One line on every rank if the ranks do not share a host."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size = SharedWire.file_bytes(world, capacity)
    where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    named, mapped = [None], None
    try:
        if rank == 0:
            token = secrets.randbits(62)
            path = os.path.join(where, f"tensor_parallel_toy-wire-{os.getpid()}-{token:x}")
            named = [(path, token)]
            mapped = _map(path, size, create=True)
            memoryview(mapped)[:8].cast("q")[0] = token  # in the unused counter of pair (0, 0)
        dist.broadcast_object_list(named, src=0)
        path, token = named[0]
        if rank != 0:
            try:
                mapped = _map(path, size, create=False)
            except OSError:
                pass
        ok = mapped is not None and memoryview(mapped)[:8].cast("q")[0] == token
        if ok:  # a page's first touch costs more than its copy: touch every page we write
            wire = SharedWire(mapped, world, rank, capacity)
            for stream in wire.out.values():
                ctypes.memset(stream.base, 0, stream.capacity)
        everyone = [None] * world
        dist.all_gather_object(everyone, ok)
    finally:
        if rank == 0 and named[0] is not None:
            os.unlink(named[0][0])  # every rank has mapped it (or failed): nothing stays behind
    if not all(everyone):
        missing = [i for i, seen in enumerate(everyone) if not seen]
        raise RuntimeError(f"--link model: ranks {missing} cannot open rank 0's shared memory "
                           f"{path}: the modeled wire needs every rank on one host")
    for stream in wire.into.values():  # and every page we read (their writers zeroed them)
        ctypes.string_at(stream.base, stream.capacity)
    yield wire
