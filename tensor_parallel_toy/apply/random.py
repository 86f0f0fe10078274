"""The tensor-parallel region's own random stream: dropout on this rank's heads or columns draws
a mask of its own on each rank, while the rest of the model draws one device's masks.

Two regions of a TP + SP model hold activations that differ across the ranks:

    SP region   [b, s/p, h]   this rank's rows; a dropout there (SequenceParallelDropout) draws
                              one device's whole mask and keeps its slice, so it needs the
                              default generator in the same state on every rank
    TP region   [b, s, h/p]   this rank's heads or columns: from a ColwiseParallel layer whose
                              output stays split (Shard(-1)) until the RowwiseParallel layer
                              that consumes it; `F.scaled_dot_product_attention(dropout_p=..)`,
                              or a dropout on attention probabilities [b, heads/p, s, s] there
                              would draw, from that same state, the same mask on every rank:
                              heads on different ranks would share one mask

Megatron's model-parallel RNG tracker (megatron/core/tensor_parallel/random.py) gives the TP
region a second stream, seeded differently on each TP rank. Here the swap is done at the
region's borders, so the model's own code (its dropout, SDPA's dropout_p) needs no change:

    PlannedColumn, output split  ->  enter(): the default generators now draw this rank's stream
    PlannedRow begins            ->  leave(): back to the normal stream, the same on every rank
    the root module's forward ends (or raises)  ->  leave()

`enter` is idempotent (q, k and v as three column layers each enter), and a column layer whose
output is gathered (Replicate()) does not enter: what follows it is the same on every rank.
The generators swapped are the CPU's and, when the activations are on a GPU, that device's
(two lines below name a device type). Outside the region neither stream is touched, so the
normal stream moves exactly as one device's would for the draws made there.

Backward draws nothing: dropout's mask is saved by autograd in forward. Activation
checkpointing, which reruns a block's forward in backward, would have to save both streams'
states (this one's `states` and the default generators') before the block and set them again
before the rerun, as Megatron's CheckpointFunction does; nothing here does that yet.
"""
import contextlib

import torch
import torch.distributed as dist

from ..comm import group_rank, group_size

# Megatron's offset: keeps rank 0's stream away from the default stream seeded with the same
# seed (offset 0 would give rank 0 the very masks the SP region draws).
TP_SEED_OFFSET = 2718


def default_generators(device):
    """The default generators a draw on `device` uses: the CPU's, and the GPU's when on one."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"cpu": torch.default_generator,
                f"cuda:{index}": torch.cuda.default_generators[index]}
    return {"cpu": torch.default_generator}


class TensorParallelRandom:
    """This rank's random stream for the TP region of one TP group, swapped into the default
    generators while the forward is inside that region.

    `seed`: the stream's seed is seed + TP_SEED_OFFSET + this rank's index in the group, so it
    differs on every TP rank and is the same for the same TP rank of every data-parallel
    replica (Megatron's choice). `states` holds the stream's state per device while outside.
    """

    def __init__(self, tp_group, seed):
        self.rank, self.seed = group_rank(tp_group), seed
        self.states = {}  # device -> this stream's state, kept while outside the region
        self.normal = None  # device -> the normal stream's state, kept while inside
        self.device = None  # where the activations of the region are

    @property
    def inside(self):
        return self.normal is not None

    def manual_seed(self, seed):
        """Start the stream again from `seed` (offset by this rank as above)."""
        self.seed, self.states = seed, {}
        return self

    def fresh_state(self, device):
        """The stream's state on `device` before any draw (a generator of its own: seeding it
        draws nothing from the default one)."""
        return torch.Generator(device=device).manual_seed(
            self.seed + TP_SEED_OFFSET + self.rank).get_state()

    def drew(self, since):
        """Whether the stream drew since `since` (a copy of `states` taken then)."""
        return any(not torch.equal(state, since[name] if name in since else
                                   self.fresh_state(name)) for name, state in self.states.items())

    def enter(self, device):
        """The default generators of `device` (and the CPU's) draw this rank's stream from now."""
        if self.inside:
            return
        generators = default_generators(device)
        self.normal, self.device = {}, device
        for name, gen in generators.items():
            if name not in self.states:
                self.states[name] = self.fresh_state(name)
            self.normal[name] = gen.get_state()
            gen.set_state(self.states[name])

    def leave(self):
        """Back to the normal stream, where `enter` left it; this stream keeps its place."""
        if not self.inside:
            return
        for name, state in self.normal.items():
            gen = default_generators(name)[name]
            self.states[name] = gen.get_state()
            gen.set_state(state)
        self.normal = None

    @contextlib.contextmanager
    def normal_stream(self):
        """Inside the region, draw from the normal stream for a while (SequenceParallelDropout
        on heads: one device's whole mask, the same on every rank), then come back."""
        if not self.inside:
            yield
            return
        device = self.device
        self.leave()
        try:
            yield
        finally:
            self.enter(device)

    def __repr__(self):
        return (f"TensorParallelRandom(seed={self.seed}, rank={self.rank}, "
                f"{'inside' if self.inside else 'outside'} the region)")


# One stream per TP group in a process, like the default generator it shadows: a plan applied
# in several calls (the root, then each block) must share it, or each block's stream would
# start from the same seed and replay the other blocks' masks.
_STREAMS = {}


def random_stream(tp_group, seed=None):
    """The TP-region stream of `tp_group` in this process (None when the group has one rank:
    nothing differs across ranks). `seed` (re)starts it; None on first use takes the seed the
    user gave torch.manual_seed (torch.initial_seed()), which reads the default generator
    without drawing from it: drawing a seed would move the normal stream, and the model split
    over ranks would no longer draw the SP region's masks one device draws from that seed."""
    if group_size(tp_group) == 1:
        return None
    key = tuple(dist.get_process_group_ranks(tp_group))
    if key not in _STREAMS:
        _STREAMS[key] = TensorParallelRandom(tp_group, torch.initial_seed() if seed is None
                                             else seed)
    elif seed is not None:
        _STREAMS[key].manual_seed(seed)
    return _STREAMS[key]


def attach_random_stream(module, tp_group, seed=None):
    """Give `module`'s planned layers (those with a `random_stream` slot) the stream of
    `tp_group`, and make the root's forward leave the region when it ends or raises (a head
    whose output stays split ends the forward inside it). Returns the stream."""
    stream = random_stream(tp_group, seed)
    if stream is None:
        return None
    for layer in module.modules():
        if hasattr(layer, "random_stream"):
            layer.random_stream = stream
    module.register_forward_pre_hook(lambda mod, args: stream.leave())
    module.register_forward_hook(lambda mod, args, out: stream.leave(), always_call=True)
    return stream


__all__ = ["TP_SEED_OFFSET", "TensorParallelRandom", "attach_random_stream",
           "default_generators", "random_stream"]
