"""Streaming DiLoCo's schedule: which parameters form each fragment, and after which inner
steps a fragment's all-reduce starts and its outer step is applied.

Symbols: H inner steps per outer step, F fragments, tau the inner steps a fragment's
all-reduce overlaps (its outer step's staleness, lecture 06's tau). Plain DiLoCo is F = 1,
tau = 0: everything synchronised after steps H, 2H, ...

- Fragments are strided (Douillard et al. 2025, "Streaming DiLoCo with overlapping
  communication", arXiv 2501.18512: a strided pattern of layers spreads each
  fragment over the depth): parameter tensor j belongs to fragment j mod F.
- Staggered: fragment i (0-based) is sent after inner steps o_i, o_i + H, o_i + 2H, ... with
  o_i = floor((i + 1) H / F), so one fragment leaves every H/F steps and the last one at H,
  2H, ... as in DiLoCo; torchft's ``DiLoCo`` counts ``fragment_sync_offset`` the same way.
- Overlapped: its averaged pseudo-gradient is applied tau inner steps later, after inner
  step o_i + k H + tau (torchft's ``fragment_sync_delay``, which its docstring calls the
  paper's tau).
"""

from parlab._checks import whole_number


def strided_fragments(parameters, fragments):
    """The F fragments of ``parameters`` (a list of tensors): fragment i holds tensors i, i + F,
    i + 2F, ... A ValueError if a fragment would be empty."""
    parameters = list(parameters)
    F = whole_number("fragments (F)", fragments, "e.g. fragments=1 for plain DiLoCo.")
    if F > len(parameters):
        raise ValueError(f"fragments (F) = {F} is more than the {len(parameters)} parameter tensors to cut: "
                         f"pass fragments={len(parameters)} or fewer (a fragment is a set of whole tensors).")
    return [parameters[i::F] for i in range(F)]


def sync_offsets(inner_steps, fragments):
    """[o_0, ..., o_{F-1}]: fragment i is first sent after inner step o_i = floor((i + 1) H / F).
    sync_offsets(8, 4) == [2, 4, 6, 8]."""
    H = whole_number("inner_steps (H)", inner_steps, "e.g. inner_steps=500 as in the DiLoCo paper, or 1.")
    F = whole_number("fragments (F)", fragments, "e.g. fragments=1 for plain DiLoCo.")
    if F > H:
        raise ValueError(f"fragments (F) = {F} is more than inner_steps (H) = {H}: at most one fragment leaves "
                         "per inner step, so pass fragments <= inner_steps.")
    return [((i + 1) * H) // F for i in range(F)]


def due(step, inner_steps, fragments, delay=0):
    """The fragments whose all-reduce starts (``delay`` 0) or whose outer step is applied
    (``delay`` tau) after inner step ``step`` (counted from 1)."""
    return [i for i, offset in enumerate(sync_offsets(inner_steps, fragments))
            if step - delay >= offset and (step - delay - offset) % inner_steps == 0]
