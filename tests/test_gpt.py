"""parlab.gpt: the shipped text loads as package data, batches are (input, target) shifted by
one character, the model maps (b, s) tokens to (b, s, V) logits and learns the text, and bad
sizes raise ValueErrors that say what to change."""

import pytest
import torch

from parlab.gpt import GPT, CharDataset, GPTConfig, load_text


def test_the_text_ships_with_the_package_and_fits_the_default_vocabulary():
    text = load_text()
    assert 2_000 < len(text) < 50_000
    data = CharDataset()
    assert data.V == len(set(text)) <= GPTConfig().V
    assert data.decode(data.encode("tensor parallel")) == "tensor parallel"


def test_a_batch_is_b_windows_of_s_characters_and_their_next_characters():
    data = CharDataset("abcdefghij")
    x, y = data.batch(3, 4, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 4)
    for inputs, targets in zip(x, y):
        window = data.decode(inputs) + data.decode(targets[-1:])
        assert window in "abcdefghij" and data.decode(targets) == window[1:]


def test_the_model_maps_tokens_to_logits_and_learns_the_text():
    torch.manual_seed(0)
    config = GPTConfig(V=64, s=16, h=32, a=4, L=2)
    model, data = GPT(config), CharDataset()
    generator = torch.Generator().manual_seed(0)
    x, y = data.batch(8, config.s, generator)
    assert model(x).shape == (8, config.s, config.V)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = model.loss(x, y).item()
    for _ in range(30):
        optimizer.zero_grad()
        model.loss(x, y).backward()
        optimizer.step()
    assert model.loss(x, y).item() < first / 2


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(V=64, s=16, h=32, a=4, L=2))
    x = torch.randint(64, (1, 16))
    changed = x.clone()
    changed[0, 10] = (x[0, 10] + 1) % 64
    assert torch.equal(model(x)[0, :10], model(changed)[0, :10])
    assert not torch.equal(model(x)[0, 10:], model(changed)[0, 10:])


def test_bad_sizes_say_what_to_change():
    with pytest.raises(ValueError, match="h = 30 does not split into a = 4 heads: choose h a multiple of a"):
        GPTConfig(h=30, a=4)
    with pytest.raises(ValueError, match=r"GPTConfig.L must be a whole number >= 1, got 0"):
        GPTConfig(L=0)
    with pytest.raises(ValueError, match="dropout is a probability"):
        GPTConfig(dropout=1.5)
    with pytest.raises(ValueError, match="longer than the model's s = 16: cut it, or build the model with a larger"):
        GPT(GPTConfig(s=16, h=32))(torch.zeros(1, 17, dtype=torch.int64))
    with pytest.raises(ValueError, match="too few for sequences of s = 20"):
        CharDataset("short").batch(1, 20)
