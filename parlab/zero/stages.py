"""ZeRO stages 0, 1 and 2: data parallelism that keeps each rank's share of the model states.

Every rank still holds the full parameters and runs a plain forward and backward on its
shard of the batch, as in DDP. What differs is what each rank keeps between steps and what
moves. With Psi trainable parameters on N_d ranks, in fp32 (4 bytes per parameter and per
gradient; kappa bytes of optimizer state per parameter, kappa = 8 for Adam, 4 for SGD momentum;
the ZeRO paper writes K for kappa):

    stage  ZeroDP(..., stage=s)   sharded           bytes per rank                    traffic per rank and step
    0      baseline DDP           nothing           4 Psi + 4 Psi + kappa Psi         all-reduce of the gradients
                                                                                      (RS + AG of 4 Psi bytes),
                                                                                      in buckets during backward
    1      P_os                   optimizer state   4 Psi + 4 Psi + kappa Psi / N_d   RS of the gradients
                                                                                      + AG of the parameters
    2      P_os+g                 + gradients       4 Psi + (4 + kappa) Psi / N_d     the same

A ring reduce-scatter (RS) or all-gather (AG) of D bytes sends (N_d - 1)/N_d D bytes per
rank, so every stage here sends 2 (N_d - 1)/N_d x 4 x padded Psi bytes per step: sharding
the optimizer state and the gradients costs no extra communication. (Stage 3 shards the
parameters too and pays a third collective: ``parlab.zero.FSDP``.)

    engine = ZeroDP(model, torch.optim.Adam, stage=2, lr=1e-3)
    engine.zero_grad()
    loss_fn(engine(x_shard), y_shard).backward()   # each rank's mean loss over its shard
    engine.step()                                  # RS gradients, step my shard, AG parameters

How the bytes stay equal to the formula. The trainable parameters live in one flat fp32
buffer (``parlab.flat.FlatLayout``, padded to a multiple of N_d): every module
parameter is a view into it, so the all-gather writes straight into the model. At stages 1
and 2 the inner optimizer (the given torch class) sees ONE Parameter, ``shard``, the view of
this rank's shard of the flat buffer (rank r: shard r). Being a view, the shard adds no
parameter bytes (no fp32 master copy is needed: in fp32 the parameters are the master
parameters) and the optimizer's step writes the new values in place, ready to be gathered;
the optimizer allocates its state for the shard only, kappa Psi / N_d. Since Adam, AdamW and
SGD with momentum act elementwise, stepping the shard equals stepping the full parameters.
Stage 0 has nothing to shard: its optimizer steps the model's own parameters (views of the
flat buffer), as DDP + ``optimizer_class(model.parameters())`` does, kappa Psi bytes of state
and a step count per parameter. (Over one flat tensor of padded Psi elements, Adam would
allocate temporaries of that size at every step; on a CPU their page faults and cache misses
made stage 0's optimizer step 1.5 to 2 times torch's. ``shard`` is then the whole flat buffer, for an
optimizer of your own.)

Gradients. Stages 0 and 1 keep one flat gradient buffer (4 Psi) whose views are the module
gradients. At stage 1 backward accumulates straight into it. Stage 0 all-reduces it during
backward, as ``parlab.ddp.DDP("bucketed")`` does, with the all-reduce DDP takes in the regime
(torch's ``dist.all_reduce`` in real time, parlab's ring on an emulated link:
``parlab.ddp.engine.regime_all_reduce``): cut into buckets of up to ``bucket_cap_mb`` in the
order backward produces them (``parlab.zero.buckets.AllReduceBuckets``; without a
``bucket_cap_mb``, the first bucket closes at 1 MiB, as torch's DDP's), each bucket's range is
all-reduced in place on the rank's communication thread (``parlab.background``) as soon as
backward has produced its gradients, while backward computes the next ones;
``finish_gradient_synchronization`` waits for them. Its gradients go as torch's DDP's with
``gradient_as_bucket_view=True``: ``zero_grad`` sets them to None, backward hands over its own
and a hook divides each by N_d into its view, which becomes the module's gradient, so the sum
of the ranges is the average (one pass over the gradients, where zeroing the buffer, adding
into it and dividing after the all-reduce took three). Each range holds a multiple of N_d
elements, so on the ring the bytes are exactly one ring all-reduce of padded Psi. Stage 1
reduce-scatters the flat gradient once after backward, which leaves the average in the own
shard (the other shards hold partial sums, unused). Stage 2 never holds the full
gradient: as DeepSpeed's ZeRO-2 with ``overlap_comm``, it reduce-scatters the gradients during
backward, bucket by bucket (``parlab.zero.buckets.GradientBuckets``: up to ``bucket_cap_mb``
each, in the order backward produces them), each launched on the communication thread as soon
as its bucket is full; the thread adds this rank's averaged part into the shard's gradient
(4 Psi / N_d), and the bucket is freed when it has been waited for: when the next bucket is
launched (one bucket in flight while the next one fills), or in
``finish_gradient_synchronization``. The same additions in the same order as stage 1's RS:
the result is bit for bit equal, and the bytes sent are the same, in more messages.

Peak gradient memory, measured: ``engine.peak_gradient_bytes`` is the largest
``gradient_bytes()`` seen since the last ``zero_grad`` (read at every gradient's arrival and
before the optimizer step): the storages of the gradient tensors alive (flat buffer, module
gradients, stage 2's bucket buffers and shard gradient; a view counts its storage once). Not
counted: autograd's temporaries and the collectives' receive buffers. Stages 0, 1: 4 padded Psi
bytes. Stage 2: 4 padded Psi / N_d + the largest (bucket in flight + bucket buffer + one
gradient) alive at once (``engine.buckets.peak_bytes()``, the formula of
``parlab.zero.formulas``), below stage 1's when two buckets and a gradient together stay under
(N_d - 1)/N_d of the model, e.g. a bucket per layer of a model of several layers. With one
bucket for the whole model (a model under 25 MiB at the default cap) stage 2's peak is above
stage 1's: the bucket's buffer is a whole flat gradient, with each gradient beside it while it
is added in, and the shard's gradient allocated beside it at its launch. Its saving is then
only the 4 padded Psi (N_d - 1)/N_d bytes it does not keep between steps.

Offload (ZeRO-Offload; ``offload=True``, stages 1 and 2). The optimizer's shard is a host (CPU)
copy of this rank's fp32 parameter shard and the optimizer keeps its state there: kappa Psi / N_d
bytes of state (Psi padded, here and below) leave the device, and the host holds the shard,
its gradient and the state, (4 + 4 + kappa) Psi / N_d (``host_state_bytes()``;
``model_state_bytes()`` is then the device's part: 4 Psi of parameters, the gradients of the
stage, no optimizer state; both ``parlab.zero.formulas.offload_state_bytes``). Each step moves
the averaged gradient shard to the host after the RS and the updated parameter shard back
before the AG: 4 Psi / N_d bytes each way per rank (``parlab.zero.formulas.offload_bytes_per_step``),
counted from the tensors copied in ``engine.offload_bytes``.
(ZeRO-Offload computes in fp16 and sends 2-byte parameters back; here all is fp32.) Without
an accelerator host and device are the same CPU: the copies are real, in one memory.

Frozen parameters (``requires_grad=False``) are left as they are: not flattened, not
sharded, not counted. Construction broadcasts rank 0's trainable parameters (one
``parlab.p2p.broadcast`` of the flat buffer), frozen parameters and buffers, so the replicas
start equal. Checkpoints (full and sharded state dicts, files): ``parlab.zero.checkpoint``.
"""


import torch

from parlab import _checks, collectives, p2p, trace
from parlab._hooks import weak_hook
from parlab.flat import FlatLayout
from parlab.memory import measure_model_state
from parlab.zero.buckets import FIRST_BUCKET_MB, AllReduceBuckets, GradientBuckets

STAGES = (0, 1, 2)


class ZeroDP(torch.nn.Module):
    """ZeRO stage ``stage`` (0, 1 or 2; table above) over the N_d ranks of ``group`` (a
    process group from ``dist.new_group``, e.g. the data-parallel axis of a grid; default:
    all ranks).

    ``model``: the same module built on every rank; ``optimizer_class``: a torch optimizer
    class (not an instance), built over the shard (stage 0: the model's trainable parameters)
    with ``**optimizer_kwargs``. None: the engine builds none; build yours over
    ``[engine.shard]`` (this rank's shard, a Parameter) and call, each step,
    ``engine.zero_grad()``, backward, ``engine.finish_gradient_synchronization()`` and your
    ``optimizer.step()``: the next forward (or ``full_parameters()``) all-gathers the updated
    shards first. The trainable parameters must share one floating dtype and device. Call the
    engine like the model, then ``step()`` after ``loss.backward()``, and ``zero_grad()`` on the
    engine (not on the model: module gradients are views into the engine's flat buffer).
    ``bucket_cap_mb`` (stages 0 and 2, default 25 MiB): the largest bucket of gradients
    all-reduced (stage 0) or reduce-scattered (stage 2) together during backward; at stage 0
    the default also makes the first bucket 1 MiB, as torch's DDP.
    ``offload=True`` (stages 1, 2; ZeRO-Offload): the optimizer's shard and state live in host
    memory (section "Offload" above). Wrap a model once: the engine's gradient hooks stay on
    its parameters (at stages 0 and 2 they launch the buckets' collectives). With ``group``,
    only its members construct and call the engine; every collective (the first broadcast,
    reduce-scatters, all-gathers) stays inside it, rank r being the place in the group.
    """

    def __init__(self, model, optimizer_class=None, stage=2, bucket_cap_mb=None, offload=False, group=None,
                 **optimizer_kwargs):
        super().__init__()
        if stage not in STAGES:
            raise ValueError(
                f"ZeroDP implements ZeRO stages 0, 1 and 2, got stage={stage!r}; stage 3 (parameters "
                "sharded too) is parlab.zero.FSDP(model, optimizer_class, strategy='FULL_SHARD')."
            )
        _checks.module("model", model, "pass the model to shard, built the same on every rank.")
        if optimizer_class is not None:
            _checks.optimizer_class(optimizer_class)
        elif optimizer_kwargs:
            raise ValueError(f"optimizer options {sorted(optimizer_kwargs)} need an optimizer_class: pass one, or "
                             "drop them and give them to the optimizer you build over [engine.shard].")
        if bucket_cap_mb is not None and stage == 1:
            raise ValueError("bucket_cap_mb is for stages 0 and 2, which reduce their gradients in buckets during "
                             "backward; stage 1 reduce-scatters the whole flat gradient after it: drop it.")
        if offload not in (True, False) or (offload and stage == 0):
            raise ValueError(f"offload=True moves this rank's shard of the optimizer state to the host: it needs "
                             f"stage 1 or 2 (got stage={stage}, offload={offload!r}); pass True or False.")
        first_bucket_mb = FIRST_BUCKET_MB if bucket_cap_mb is None else None  # torch DDP's, with its default cap
        bucket_cap_mb = _checks.real_number(
            "bucket_cap_mb (the size of a bucket in MiB)", 25 if bucket_cap_mb is None else bucket_cap_mb,
            "a bucket must hold something: pass a number of MiB such as 25 (math.inf: one bucket).", above=True,
            infinite=True)
        self.module, self.stage, self.offload = model, stage, offload
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the model has no trainable parameters (requires_grad=True): there is nothing to train.")
        if len({(p.dtype, p.device) for p in self.trainable}) > 1 or not self.trainable[0].is_floating_point():
            raise ValueError("the trainable parameters must share one floating dtype and device; "
                             "call model.float() first.")
        self.group, self.rank, self.world_size = group, *_place_in(group)
        self.layout = FlatLayout([p.shape for p in self.trainable], self.world_size)

        self.flat_param = self.layout.flatten([p.detach() for p in self.trainable])
        p2p.broadcast_from_first([self.flat_param, *self.unsharded_tensors().values()], group)  # rank 0's values
        with torch.no_grad():
            for p, view in zip(self.trainable, self.layout.views(self.flat_param)):
                p.data = view  # the module now computes with the flat buffer
        mine = self.flat_param if stage == 0 else self.layout.shard(self.flat_param, self.rank)
        if offload:
            mine = mine.to("cpu", copy=True)  # ZeRO-Offload: the optimizer steps a host copy
        # Otherwise a view, sharing the flat buffer's storage. Not registered as the engine's parameter:
        # engine.parameters() are the model's, the shard is the optimizer's handle on them.
        object.__setattr__(self, "shard", torch.nn.Parameter(mine))
        self.offload_bytes = {}  # bytes each copy of the last step moved between device and host
        # Stage 0 steps the model's own parameters (views of the flat buffer), as DDP + an optimizer over
        # model.parameters() does: over one flat tensor, Adam would make Psi-sized temporaries every step.
        stepped = self.trainable if stage == 0 else [self.shard]
        self.optimizer = None if optimizer_class is None else optimizer_class(stepped, **optimizer_kwargs)
        self.gather_pending = False  # the caller's optimizer may have stepped the shard: gather before use
        self.flat_grad, self.buckets, self.peak_gradient_bytes = None, None, 0
        self.synchronized = False  # finish_gradient_synchronization ran since the last step or zero_grad
        if stage == 2:
            self.buckets = GradientBuckets(self.trainable, self.layout, bucket_cap_mb, self._measure_gradients, group)
        else:
            self._attach_gradient_buffer()
            if stage == 0:  # its hooks first: a gradient is in the flat buffer when it is measured
                self.buckets = AllReduceBuckets(self.trainable, self.layout, self.flat_grad, bucket_cap_mb,
                                                first_bucket_mb, group)
            for p in self.trainable:
                p.register_post_accumulate_grad_hook(weak_hook(self._measure_gradients))

    def extra_repr(self):
        return f"stage={self.stage}, {self.layout}"

    def forward(self, *args, **kwargs):
        if self.gather_pending:
            self._share_parameters()
        if self.stage == 0:
            self.buckets.wait()  # a second backward (accumulation) writes where the first's all-reduces may be
        with trace.span("forward"):
            return self.module(*args, **kwargs)

    def step(self):
        """Average the gradients over the N_d ranks, step this rank's shard, share the result.

        Stage 0: wait for the all-reduces of the gradients, launched bucket by bucket during
        backward, then the optimizer steps the full parameters on every rank. Stage 1: RS of
        the gradients, the optimizer steps this rank's shard, AG of the parameters. Stage 2:
        wait for its buckets' reduce-scatters, launched during backward (any left, with a
        gradient missing, now); then as stage 1. With ``offload``,
        the averaged gradient shard goes to the host before the optimizer step and the updated
        parameter shard comes back before the all-gather. The averaging is
        ``finish_gradient_synchronization`` (unless called already since the backward).
        """
        if self.optimizer is None:
            raise ValueError("this ZeroDP was built without an optimizer (optimizer_class=None): call step() on the "
                             "optimizer you built over [engine.shard], after engine.finish_gradient_synchronization().")
        if not self.synchronized:
            self.finish_gradient_synchronization()
        with trace.span("optimizer"):
            self.optimizer.step()
        self._share_parameters()
        self.synchronized = False

    def _share_parameters(self):
        """After the optimizer step: the shard back to the device (offload), then the all-gather."""
        if self.offload:
            with trace.span("parameters to device"), torch.no_grad():
                self.layout.shard(self.flat_param, self.rank).copy_(self.shard)
            self.offload_bytes["parameters to device"] = self.shard.nbytes
        if self.stage > 0:
            with trace.span("all-gather parameters"):
                collectives.ring_all_gather(self.flat_param, check=False, group=self.group)
        self.gather_pending = False

    def finish_gradient_synchronization(self):
        """The first half of ``step``, as DDP's method of that name: after the step's last
        backward, average the gradients over the N_d ranks. Afterwards ``self.shard.grad``
        holds this rank's averaged shard (stage 0: the whole averaged gradient), on the host
        with ``offload``; ``step()`` then takes the optimizer step without averaging again."""
        if self.stage == 2:
            if not self.buckets.finish():
                raise ValueError("step() needs this step's gradients: run forward through the engine and "
                                 "backward first.")
            averaged = self.buckets.gradient
        elif self.stage == 1:
            self._check_gradients()
            with trace.span("reduce-scatter gradients"):
                collectives.ring_reduce_scatter(self.flat_grad, op="avg", check=False, group=self.group)
                averaged = self.layout.shard(self.flat_grad, self.rank)
        if self.stage == 0:
            self.buckets.finish()  # its "all-reduce gradients" spans are the communication thread's
            self._check_gradients()
            self.shard.grad = self.flat_grad
        elif self.offload:
            with trace.span("gradients to host"):
                self.shard.grad = averaged.to("cpu", copy=True)
            self.offload_bytes["gradients to host"] = averaged.nbytes
            if self.stage == 2:
                self.buckets.gradient = None  # the device's copy is no longer needed
        else:
            self.shard.grad = averaged
        self._measure_gradients()
        self.synchronized, self.gather_pending = True, self.optimizer is None

    def zero_grad(self):
        """Zero the gradients for the next step: stage 1 zeroes the flat gradient buffer in
        place (module gradients stay views into it); stage 0 sets the module gradients to None
        (backward's next gradients are divided into their views); stage 2 drops its gradient
        shard. Starts a new measurement of ``peak_gradient_bytes``."""
        if self.stage == 1:
            self.flat_grad.zero_()
        else:
            self.buckets.discard()  # waits for the collectives in flight first
            if self.stage == 2:
                self.shard.grad = None
        self.peak_gradient_bytes, self.synchronized = 0, False
        self._measure_gradients()

    def gradient_bytes(self):
        """Bytes of the gradient tensors alive on this rank now: the flat gradient (stages 0,
        1), the module gradients, stage 2's bucket buffers and gradient shard, each storage
        once (views of the flat gradient add nothing)."""
        buffers = [*self.buckets.buffers(), self.buckets.gradient] if self.stage == 2 else []
        tensors = [self.flat_grad, self.shard.grad, *(p.grad for p in self.trainable), *buffers]
        return measure_model_state([], tensors, []).grads

    def _measure_gradients(self, _parameter=None):  # also a gradient hook, given the parameter
        self.peak_gradient_bytes = max(self.peak_gradient_bytes, self.gradient_bytes())

    def model_state_bytes(self):
        """The ``parlab.memory.ModelState`` this rank holds on its device, measured from its
        storages (with ``offload``, what the host holds is ``host_state_bytes()``)."""
        grads = [self.flat_grad, *(p.grad for p in self.trainable),
                 *([*self.buckets.buffers(), self.buckets.gradient] if self.stage == 2 else [])]
        if self.offload:
            return measure_model_state([self.flat_param, *self.trainable], grads, [])
        return measure_model_state([self.flat_param, *self.trainable], [*grads, self.shard.grad], self._states())

    def host_state_bytes(self):
        """With ``offload``: the ``ModelState`` in host memory, the optimizer's shard (params),
        its gradient (grads) and its state (optimizer); without, zeros."""
        if not self.offload:
            return measure_model_state([], [], [])
        return measure_model_state([self.shard], [self.shard.grad], self._states())

    def _states(self):
        states = self.optimizer.state.values() if self.optimizer is not None else []
        return [value for state in states for value in state.values() if torch.is_tensor(value)]

    def full_parameters(self):
        """{name: full parameter}, frozen ones included: every rank holds them all already
        (after the all-gather a caller's optimizer step left pending)."""
        if self.gather_pending:
            self._share_parameters()
        return {name: p.detach().clone() for name, p in self.module.named_parameters()}

    def full_gradients(self):
        """{name: averaged gradient} of the trainable parameters, on every rank, after
        ``finish_gradient_synchronization``: stage 0 holds it whole, stages 1 and 2 all-gather
        the ranks' averaged shards (a fresh buffer: the engine's own are not touched)."""
        if not self.synchronized:
            raise ValueError("full_gradients() needs the averaged gradients: call it after backward and "
                             "finish_gradient_synchronization(), before step().")
        grad = self.shard.grad.to(self.flat_param.device)
        if self.stage > 0:
            flat = torch.zeros_like(self.flat_param)
            self.layout.shard(flat, self.rank).copy_(grad)
            grad = collectives.ring_all_gather(flat, check=False, group=self.group)
        names = [name for name, p in self.module.named_parameters() if p.requires_grad]
        return {name: view.clone() for name, view in zip(names, self.layout.views(grad))}

    def _check_gradients(self):
        views = self.layout.views(self.flat_grad)
        if any(p.grad is None or p.grad.data_ptr() != v.data_ptr() for p, v in zip(self.trainable, views)):
            raise ValueError(
                "step() needs the gradients in the engine's flat buffer: run forward through the engine "
                "and backward first, and zero them with engine.zero_grad(), not model.zero_grad()."
            )

    def _attach_gradient_buffer(self):
        self.flat_grad = torch.zeros_like(self.flat_param)
        for p, view in zip(self.trainable, self.layout.views(self.flat_grad)):
            p.grad = view

    def unsharded_tensors(self):
        """Frozen parameters and buffers by name: whole on every rank."""
        frozen = {name: p for name, p in self.module.named_parameters() if not p.requires_grad}
        return {**frozen, **dict(self.module.named_buffers())}


def _place_in(group):
    """(r, N_d): this rank's place in ``group`` and its size; a ValueError for a non-member."""
    rank = torch.distributed.get_rank(group)
    if rank < 0:
        raise ValueError(f"global rank {torch.distributed.get_rank()} is not in the group it passed: build the engine "
                         "(or the optimizer) only on the group's members (each rank passes the group it belongs to).")
    return rank, torch.distributed.get_world_size(group)


