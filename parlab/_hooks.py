"""Tensor hooks that do not keep their engine alive.

Autograd keeps a tensor's hooks in C++, where Python's garbage collector cannot follow them. A
hook bound to the engine that owns the tensor (DDP's, ZeroDP's, FSDP's gradient hooks) closes
a cycle the collector never sees: parameter -> hook -> engine -> model -> parameter. Such an
engine, its model, its optimizer state and its process group (whose gloo threads wake every
10 ms) then outlive every reference a learner holds. ``weak_hook`` breaks the cycle: the hook
holds its engine weakly, and does nothing once the engine is gone.
"""

import weakref


def weak_hook(method, *args):
    """A hook calling ``method(*args, *hook_arguments)`` while ``method``'s object lives
    (``method`` is a bound method, e.g. ``self.gradient_ready``); nothing once it is gone."""
    reference = weakref.WeakMethod(method)

    def hook(*hook_arguments):
        bound = reference()
        return None if bound is None else bound(*args, *hook_arguments)

    return hook
