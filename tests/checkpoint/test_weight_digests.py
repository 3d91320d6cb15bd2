"""Weights meshfit writes outside its checkpoints carry digests, and every meshfit reader
checks them (`meshfit.checkpoint.weight_digests`).

One flipped bit in ``OUT/model/model.safetensors`` (an exponent bit: the value changes by
orders of magnitude, the file still parses) is refused, naming the file, the bytes and the
tensors in them, by each reader: `load_model_folder` (`meshfit generate` / `meshfit eval`),
the check before a run from the folder starts (`meshfit train --model.hf_model=OUT/model`,
one line, nothing written), and a rank's own read of its slices (`load_into`). A folder
without the digest file (a user's own Hugging Face folder) still loads; the digests are
written by every writer of weights (`write_safetensors`: the model folder, `meshfit export`,
`Accelerator.save_model`) and ignored by transformers.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

transformers = pytest.importorskip("transformers")


def _flip_exponent(path, tensor: str) -> int:
    """Flip the top exponent bit of the first float32 of `tensor` in the safetensors file;
    returns the byte's offset in the file."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    assert header[tensor]["dtype"] == "F32"
    at = 8 + length + header[tensor]["data_offsets"][0] + 3  # little-endian: the sign+exponent
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    return at


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from meshfit.checkpoint.saved import save_model_folder

    root = tmp_path_factory.mktemp("digests")
    torch.manual_seed(0)  # 2.4 MB of weights: three digest blocks of 1 MiB
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=256, max_position_embeddings=32))
    save_model_folder(root / "good", model.state_dict(), model)
    shutil.copytree(root / "good", root / "flipped")
    at = _flip_exponent(root / "flipped" / "model.safetensors",
                        "model.layers.1.mlp.down_proj.weight")
    shutil.copytree(root / "flipped", root / "users")  # a folder of the user's: no digests
    (root / "users" / "meshfit-digests.json").unlink()
    return root, at


def test_a_flipped_bit_is_refused_by_every_reader_and_a_users_folder_loads(folders, tmp_path,
                                                                           capsys):
    from meshfit.checkpoint import weight_digests
    from meshfit.checkpoint.pretrained import check_weights, load_into, meta_model, to_empty
    from meshfit.checkpoint.saved import load_model_folder
    from meshfit.cli.main import main

    root, at = folders
    block = weight_digests.BLOCK
    lo, hi = at // block * block, (at // block + 1) * block
    size = (root / "flipped" / "model.safetensors").stat().st_size
    assert size > 2 * block and lo > 0  # (the bytes named are not the whole file)
    where = (rf"{root / 'flipped' / 'model.safetensors'}: bytes {lo}-{min(hi, size)} \(tensors "
             r"model\.[^)]+\) differ from their digest in meshfit-digests.json \(the file is "
             r"corrupted\)")
    # the digests are transformers' no concern: the folder loads there as any other
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "good")
    assert set(json.loads((root / "good" / "meshfit-digests.json").read_text())["files"]) == \
        {"model.safetensors"}
    # generate / eval
    load_model_folder(root / "good")
    with pytest.raises(ValueError, match=where):
        load_model_folder(root / "flipped")
    capsys.readouterr()
    assert main(["generate", str(root / "flipped"), "--prompt", "hi", "--max-new-tokens", "1",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors: bytes" in err[0], err
    # a run from the folder: before launch, one line, no run folder
    check_weights(meta_model(root / "good"), root / "good")
    capsys.readouterr()
    out = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--out", str(out),
                 f"--model.hf_model={root / 'flipped'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"meshfit train: error: model.hf_model='{root / 'flipped'}': ") and "bytes" in err[0]
    assert not out.exists()
    # each rank's read of its slices (Accelerator.prepare of a meta_model)
    model = meta_model(root / "flipped")
    to_empty(model, "cpu")
    with pytest.raises(ValueError, match=where):
        load_into(model, root / "flipped")
    # a rank reads only its slices: the blocks under them are checked, and only those
    checker = weight_digests.Checker(root / "flipped")
    checker.check("model.safetensors", 0, lo)
    checker.check("model.safetensors", hi, size)
    with pytest.raises(ValueError, match=where):
        checker.check("model.safetensors", at, at + 1)
    # a user's folder (no digests) loads as it is: the flipped value with it
    users = load_model_folder(root / "users")[0]
    name = "model.layers.1.mlp.down_proj.weight"
    assert users.state_dict()[name][0, 0] != hf.state_dict()[name][0, 0]
    check_weights(meta_model(root / "users"), root / "users")


def test_a_region_is_checked_in_the_blocks_under_its_bytes():
    """`_region_bytes`: the span of a region's elements, against the flat indices of the same
    region of an arange (an independent reference)."""
    from meshfit.checkpoint.pretrained import _region_bytes

    shape = [6, 5, 4]
    flat = torch.arange(120).view(shape)
    for index in [slice(None), (slice(2, 4),), (slice(1, 3), slice(2, 5)),
                  (slice(0, 6), slice(0, 5), slice(1, 2)), (slice(5, 6), slice(4, 5)),
                  (slice(3, 3),)]:
        got = _region_bytes(shape, index, 120 * 2)
        part = flat[index]
        want = (0, 0) if part.numel() == 0 else (int(part.min()) * 2, (int(part.max()) + 1) * 2)
        assert got == want, index


def test_writers_keep_the_digests_true(tmp_path):
    """A second write of the same file replaces its digests (never refused as corrupted); a
    digest file that is damaged is one line, not ignored."""
    from meshfit.checkpoint import weight_digests
    from meshfit.checkpoint.export import write_safetensors

    path = tmp_path / "model.safetensors"
    write_safetensors({"w": torch.ones(4)}, path)
    write_safetensors({"w": torch.zeros(8)}, path)
    assert weight_digests.check_files(tmp_path) is True
    (tmp_path / "meshfit-digests.json").write_text("{ cut")
    with pytest.raises(ValueError, match=r"meshfit-digests.json is not readable \("
                                         r"JSONDecodeError\); copy or export"):
        weight_digests.check_files(tmp_path)
    assert weight_digests.check_files(tmp_path / "nothing") is False
