"""What a rank really holds, measured from its tensors' storages."""

from parlab.memory.model_states import ModelState


def storage_bytes(tensors):
    """Bytes actually held by ``tensors``: the sum of ``nbytes`` of their unique untyped
    storages. A view counts its whole storage, once, however many views of it are given; a
    storage resized to 0 (a freed shard) counts 0; ``None`` entries are skipped. Works for
    tensors on any device (storages are told apart by device and data pointer)."""
    return _count_unique_storages(tensors, set())


def measure_model_state(params, grads, optimizer_state):
    """The ``ModelState`` of one rank measured from its tensors: each argument an iterable of
    tensors (``optimizer_state`` e.g. every tensor in ``optimizer.state.values()``).

    Categories are counted in the order params, grads, optimizer, and a storage already
    counted in an earlier category is not counted again: a gradient that is a view into the
    parameters' flat buffer adds nothing to ``grads``."""
    seen = set()
    return ModelState(
        params=_count_unique_storages(params, seen),
        grads=_count_unique_storages(grads, seen),
        optimizer=_count_unique_storages(optimizer_state, seen),
    )


def _count_unique_storages(tensors, seen):
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        # An empty storage may have a null pointer shared with others: it counts 0 anyway.
        key = (str(tensor.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
