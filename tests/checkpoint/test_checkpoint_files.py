"""Checkpoint folders, in one process: bad checkpoints are refused with one line before any
tensor is read, nothing is ever unpickled, and only complete checkpoints are found."""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from meshfit import Accelerator
from meshfit.checkpoint import CheckpointError, latest, list_complete, prune
from reference import tiny_gpt

pytestmark = pytest.mark.usefixtures("one_thread")


def _prepared(**model):
    acc = Accelerator()
    net = acc.prepare(tiny_gpt(n_layer=1, dtype=torch.float32, **model))
    opt = acc.prepare(torch.optim.AdamW(net.parameters(), lr=1e-3))
    x = torch.randint(0, 256, (2, 8))
    acc.backward(net(x, x))
    opt.step()
    return acc, net, opt


@pytest.fixture
def saved(tmp_path):
    acc, net, _ = _prepared()
    acc.save_state(tmp_path / "ckpt")
    return tmp_path / "ckpt", {k: v.clone() for k, v in net.state_dict().items()}


def test_round_trip_and_what_is_on_disk(saved):
    folder, weights = saved
    names = sorted(os.listdir(folder))
    assert names == [".metadata", "__0_0.distcp", "manifest.json"]
    acc, net, _ = _prepared()
    manifest = acc.load_state(folder)
    assert manifest.step == 1 and manifest.world_size == 1
    assert all(torch.equal(net.state_dict()[k], v) for k, v in weights.items())


def _blocks(data: bytes, block: int) -> list[str]:
    import xxhash

    return [xxhash.xxh3_128(data[i:i + block]).hexdigest() for i in range(0, len(data), block)]


def test_checksums_are_taken_while_writing_and_equal_the_files(saved):
    """Format 3: each block's XXH3-128, taken as DCP's writer streamed the file out, equals
    the digest of that block of the file on disk (an independent read)."""
    import json

    from meshfit.checkpoint.manifest import BLOCK

    folder, _ = saved
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == 3
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp"}
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "block_bytes": BLOCK,
                         "xxh3_128_blocks": _blocks(data, BLOCK)}


def _record_crc32s(data: bytes) -> list[int]:
    """The CRC-32 of every record in the zip central directories of `data` (`torch.save`'s
    files; a DCP shard holds one per item)."""
    import struct

    return [struct.unpack_from("<I", data, m.start() + 16)[0]
            for m in re.finditer(b"PK\x01\x02", data)]


def test_hashed_files_skip_torch_saves_crc32_and_no_other_save_does(saved, tmp_path):
    """`torch.save`'s CRC-32 of each record (which `torch.load` never checks) is left out of
    the files meshfit hashes, and only there: a `torch.save` after the save, or in another
    thread during one, still writes it."""
    import threading

    from meshfit.checkpoint._writer import HashingFileSystem

    folder, _ = saved
    shard = _record_crc32s((folder / "__0_0.distcp").read_bytes())
    assert len(shard) > 10 and set(shard) == {0}
    torch.save({"w": torch.randn(8)}, tmp_path / "after.pt")
    assert 0 not in _record_crc32s((tmp_path / "after.pt").read_bytes())

    fs, seen = HashingFileSystem({}, block=4096, algorithm="xxh3_128"), {}
    weight = torch.randn(8)
    with fs.create_stream(tmp_path / "hashed", "wb") as stream:
        torch.save({"w": weight}, stream)
        other = threading.Thread(target=lambda: seen.update(
            other=torch.serialization.get_crc32_options()))
        other.start()
        other.join()
    assert seen == {"other": True} and torch.serialization.get_crc32_options()
    assert set(_record_crc32s((tmp_path / "hashed").read_bytes())) == {0}
    assert torch.equal(torch.load(tmp_path / "hashed", weights_only=True)["w"], weight)
    assert fs.digests["hashed"][0] == (tmp_path / "hashed").stat().st_size


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 4 KiB, so that the tiny model's shard spans dozens of them."""
    from meshfit.checkpoint import save

    monkeypatch.setattr(save, "BLOCK", 4096)
    return 4096


def test_many_blocks_round_trip_and_a_corrupted_block_is_named(tmp_path, small_blocks):
    """A shard of many blocks: the digests taken while writing are the blocks' own, the
    state loads back bit for bit through the block-checking reader, and one flipped byte in
    a middle block is refused naming that block's bytes."""
    import json

    acc, net, _ = _prepared()
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    acc.save_state(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "__0_0.distcp"
    data = shard.read_bytes()
    entry = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["files"][shard.name]
    assert entry["block_bytes"] == small_blocks and len(entry["xxh3_128_blocks"]) > 20
    assert entry["xxh3_128_blocks"] == _blocks(data, small_blocks)
    acc2, net2, _ = _prepared(seed=1)
    assert not all(torch.equal(net2.state_dict()[k], v) for k, v in weights.items())
    acc2.load_state(tmp_path / "ckpt")
    assert all(torch.equal(net2.state_dict()[k], v) for k, v in weights.items())
    at = (len(data) // small_blocks // 2) * small_blocks + 100
    corrupted = bytearray(data)
    corrupted[at] ^= 0x10
    shard.write_bytes(bytes(corrupted))
    start = at - 100
    _refused(tmp_path / "ckpt", rf"__0_0.distcp: checksum differs from the manifest "
                                rf"\(corrupted\), in bytes {start}-{start + small_blocks}$")


def test_a_corrupted_block_past_the_first_is_named_with_its_bytes(tmp_path):
    """A shard of two blocks (one 40 MiB tensor): a flipped byte in the second block is
    refused naming that block's bytes, the line `verify` (export's check) gives too, not
    torch's error about the archive, whose zip directory lies in that block."""
    from meshfit.checkpoint.load import load_dcp
    from meshfit.checkpoint.manifest import BLOCK, Manifest, start_verify, verify
    from meshfit.checkpoint.save import commit, save_dcp

    folder = tmp_path / "ck"
    commit(save_dcp({"s": {"w": torch.randn(10 << 20)}}, folder), folder,
           Manifest(step=0, world_size=1, layout={}, model={}))
    shard = folder / "__0_0.distcp"
    size = shard.stat().st_size
    assert BLOCK < size < 2 * BLOCK
    with shard.open("r+b") as fh:
        fh.seek(BLOCK + (4 << 20))
        byte = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte ^ 0x01]))
    wanted = (rf"^{re.escape(str(shard))}: checksum differs from the manifest \(corrupted\), "
              rf"in bytes {BLOCK}-{size}$")
    manifest = start_verify(folder, hash_files=False).manifest
    with pytest.raises(CheckpointError, match=wanted):
        load_dcp({"s": {"w": torch.zeros(10 << 20)}}, folder, manifest=manifest)
    with pytest.raises(CheckpointError, match=wanted):
        verify(folder)


def test_the_block_checking_reader_returns_the_files_bytes_at_any_position(tmp_path):
    """`VerifiedStream` against the file itself: reads of every size, forwards, backwards
    and across block boundaries, return the file's bytes; a block whose bytes changed after
    the manifest was written is refused when first touched, and a file cut short too."""
    import random

    from meshfit.checkpoint._reader import VerifiedStream

    rng = random.Random(0)
    data = bytes(rng.getrandbits(8) for _ in range(10_000))
    path = tmp_path / "f"
    path.write_bytes(data)
    block = 1000
    stream = VerifiedStream(path, len(data), block, _blocks(data, block))
    for _ in range(300):
        start, n = rng.randrange(len(data) + 5), rng.randrange(2500)
        stream.seek(start)
        assert stream.read(n) == data[start:start + n]
        assert stream.tell() == min(start + n, len(data)) if start <= len(data) else True
    stream.close()
    digests = _blocks(data, block)
    digests[7] = "0" * 32
    stream = VerifiedStream(path, len(data), block, digests)
    stream.seek(6500)
    assert stream.read(400) == data[6500:6900]  # (block 7 is read ahead, not yet used)
    with pytest.raises(CheckpointError, match=r"f: checksum differs from the manifest "
                                              r"\(corrupted\), in bytes 7000-8000$"):
        stream.read(200)
    stream.close()
    path.write_bytes(data[:9500])
    stream = VerifiedStream(path, len(data), block, _blocks(data, block))
    stream.seek(9000)
    with pytest.raises(CheckpointError, match=r"f: ends at byte 9500, the manifest says "
                                              r"10000 \(truncated while loading\)"):
        stream.read(1000)
    stream.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_tensors_are_copied_from_the_checked_mapping_or_read_as_dcp_reads_them(tmp_path,
                                                                                 monkeypatch):
    """Each tensor lands in its destination equal to what was saved: copied from the file's
    mapping where its bytes can be (any dtype, views, a scalar), read with `torch.load` where
    not (a destination of another dtype, or with strides; a conjugate view, whose bytes are
    not its values); equal to DCP's own reader of the same files in every case."""
    import torch.distributed.checkpoint as dcp

    from meshfit.checkpoint import _reader
    from meshfit.checkpoint.load import load_dcp
    from meshfit.checkpoint.manifest import Manifest, start_verify
    from meshfit.checkpoint.save import commit, save_dcp

    base = torch.randn(10, 7)
    saved = {"f32": torch.randn(6, 5), "bf16": torch.randn(9, dtype=torch.bfloat16),
             "i64": torch.arange(11), "flags": torch.tensor([True, False, True]),
             "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3),
             "offset_view": torch.randn(40)[5:15], "strided_view": base[2:, 1:5],
             "to_bf16": torch.randn(4, 4), "to_strided": torch.randn(5, 6),
             "conjugate": torch.randn(3, dtype=torch.complex64).conj()}
    folder = tmp_path / "ck"
    tmp = save_dcp({"s": dict(saved)}, folder)
    commit(tmp, folder, Manifest(step=0, world_size=1, layout={}, model={}))
    mapped: dict[str, bool] = {}
    real = _reader._copy_mapped

    def counted(stream, part, base_offset, req, target):
        mapped[req.storage_index.fqn] = real(stream, part, base_offset, req, target)
        return mapped[req.storage_index.fqn]

    monkeypatch.setattr(_reader, "_copy_mapped", counted)

    def templates():
        out = {k: torch.full_like(v, 7) for k, v in saved.items()}
        out["to_bf16"] = torch.zeros(4, 4, dtype=torch.bfloat16)
        out["to_strided"] = torch.zeros(6, 5).t()
        return {"s": out}

    ours, theirs = templates(), templates()
    manifest = start_verify(folder, hash_files=False).manifest
    load_dcp(ours, folder, manifest=manifest)
    dcp.load(theirs, checkpoint_id=str(folder), no_dist=True)
    for key, value in saved.items():
        expected = value.to(ours["s"][key].dtype)
        assert torch.equal(ours["s"][key], expected), key
        assert torch.equal(theirs["s"][key], expected), key
    assert mapped == {"s.f32": True, "s.bf16": True, "s.i64": True, "s.flags": True,
                      "s.scalar": True, "s.offset_view": True, "s.strided_view": True,
                      "s.to_bf16": False, "s.to_strided": False,
                      "s.conjugate": False}  # ("empty": nothing to copy)


def test_a_part_of_a_saved_chunk_is_copied_from_its_offset(tmp_path):
    """A read item asking for part of a saved chunk (a shard resharded to another layout):
    rows (one byte range, at an offset inside the record) are copied from the mapping;
    columns (strided) are left to `torch.load`."""
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from meshfit.checkpoint._reader import VerifiedStream, _copy_mapped, _Part

    chunk = torch.randn(8, 6)
    archive = io.BytesIO()
    torch.save(chunk, archive)
    data = b"x" * 13 + archive.getvalue()  # (an item starts anywhere in a DCP file)
    path = tmp_path / "f"
    path.write_bytes(data)

    def item(offsets, lengths):
        return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("w"),
                        dest_offsets=torch.Size([0, 0]), storage_index=MetadataIndex("w"),
                        storage_offsets=torch.Size(offsets), lengths=torch.Size(lengths))

    stream = VerifiedStream(path, len(data), 64, _blocks(data, 64))
    rows = torch.zeros(3, 6)
    assert _copy_mapped(stream, _Part(stream, 13, len(data) - 13), 13, item([2, 0], [3, 6]),
                        rows)
    assert torch.equal(rows, chunk[2:5])
    cols = torch.zeros(8, 3)
    assert not _copy_mapped(stream, _Part(stream, 13, len(data) - 13), 13,
                            item([0, 1], [8, 3]), cols)
    assert torch.equal(cols, torch.zeros(8, 3))
    with pytest.raises(RuntimeError, match=r"w: the checkpoint holds a part of size \(3, 6\), "
                                           r"this job's is \(2, 6\)"):
        _copy_mapped(stream, _Part(stream, 13, len(data) - 13), 13, item([2, 0], [3, 6]),
                     torch.zeros(2, 6))
    stream.close()


def test_a_format_2_checkpoint_with_whole_file_digests_still_loads_and_is_checked(saved):
    """Checkpoints of format 2 carry one XXH3-128 per file: they load, and a corrupted one
    is refused before any of its bytes is read."""
    import json

    import xxhash

    folder, weights = saved
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["format"] = 2
    manifest["files"] = {name: {"bytes": e["bytes"], "xxh3_128": xxhash.xxh3_128(
        (folder / name).read_bytes()).hexdigest()} for name, e in manifest["files"].items()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    acc, net, _ = _prepared()
    assert acc.load_state(folder).format == 2
    assert all(torch.equal(net.state_dict()[k], v) for k, v in weights.items())
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0x01
    shard.write_bytes(bytes(data))
    _refused(folder, r"__0_0.distcp: checksum differs from the manifest \(corrupted\)$")


def test_a_format_1_checkpoint_with_sha256_still_loads_and_is_checked(saved):
    """Checkpoints written before format 2 carry SHA-256 digests: they load, and a corrupted
    one is refused as before."""
    import hashlib
    import json

    folder, weights = saved
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["format"] = 1
    manifest["files"] = {name: {"bytes": e["bytes"], "sha256": hashlib.sha256(
        (folder / name).read_bytes()).hexdigest()} for name, e in manifest["files"].items()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    acc, net, _ = _prepared()
    assert acc.load_state(folder).format == 1
    assert all(torch.equal(net.state_dict()[k], v) for k, v in weights.items())
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[7] ^= 0x01
    shard.write_bytes(bytes(data))
    _refused(folder, r"checksum differs from the manifest \(corrupted\)")
    manifest["format"] = 4
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _refused(folder, r"manifest format 4, this meshfit reads formats 1, 2, 3; load it with "
                     r"the meshfit that wrote it")


def test_verification_is_shared_out_by_writer_then_by_size():
    from meshfit.checkpoint.manifest import _share

    files = {"__0_0.distcp": {"bytes": 900}, "__1_0.distcp": {"bytes": 10},
             "__2_0.distcp": {"bytes": 500}, "__3_0.distcp": {"bytes": 400},
             ".metadata": {"bytes": 5}}
    # loading on 2 ranks what 4 wrote: ranks 0 and 1 check their own, the rest by size
    shares = [_share(files, r, 2) for r in range(2)]
    # (rank 1: 10 + 500 + 400 bytes; rank 0: 900 + the index's 5)
    assert shares == [[".metadata", "__0_0.distcp"], ["__1_0.distcp", "__2_0.distcp",
                                                       "__3_0.distcp"]]
    assert sorted(sum(shares, [])) == sorted(files)
    assert _share(files, 0, 1) == sorted(files)


def _refused(folder, match):
    acc, _, _ = _prepared()
    with pytest.raises(CheckpointError, match=match) as err:
        acc.load_state(folder)
    assert "\n" not in str(err.value)


def test_truncated_shard(saved):
    folder, _ = saved
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    _refused(folder, r"__0_0.distcp: \d+ bytes, the manifest says \d+ \(truncated")


def test_flipped_bytes(saved):
    folder, _ = saved
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _refused(folder, r"checksum differs from the manifest \(corrupted\)")


def test_missing_manifest(saved):
    folder, _ = saved
    (folder / "manifest.json").unlink()
    _refused(folder, r"no manifest.json; it is not a complete meshfit checkpoint")


def test_planted_file(saved):
    folder, _ = saved
    (folder / "extra.pt").write_bytes(pickle.dumps({"x": 1}))
    _refused(folder, r"extra.pt is not part of the checkpoint")


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_is_never_unpickled_freely(saved, tmp_path):
    folder, _ = saved
    (folder / ".metadata").write_bytes(pickle.dumps(_Boom()))
    # Re-sign the manifest so that only the unpickler stands in the way.
    import json

    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / ".metadata").read_bytes()
    entry = manifest["files"][".metadata"]
    entry.update(bytes=len(data), xxh3_128_blocks=_blocks(data, entry["block_bytes"]))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _refused(folder, r"refers to posix.system, which a DCP index never holds")


def test_another_models_checkpoint(saved):
    folder, _ = saved
    acc = Accelerator()
    acc.prepare(tiny_gpt(n_layer=2, dtype=torch.float32))
    with pytest.raises(CheckpointError, match=r"model 0 has no parameter 'layers.1|holds "
                                              r"parameter|has shape"):
        acc.load_state(folder)
    acc = Accelerator()
    acc.prepare(tiny_gpt(n_layer=1, d_model=32, dtype=torch.float32))
    with pytest.raises(CheckpointError, match=r"has shape \[.*\] in the checkpoint"):
        acc.load_state(folder)


def test_only_complete_checkpoints_are_found_and_pruned(saved, tmp_path):
    folder, _ = saved
    root = tmp_path / "run"
    root.mkdir()
    for step in (10, 20, 30, 50):
        shutil.copytree(folder, root / f"step-{step}")
        _edit_manifest(root / f"step-{step}", step=step)  # each named by its own step
    shutil.copytree(folder, root / "step-40.tmp-abc")  # an interrupted save
    (root / "step-50" / "manifest.json").unlink()  # never committed
    assert latest(root) == root / "step-30"
    assert [s for s, _ in list_complete(root)] == [10, 20, 30]
    prune(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-20", "step-30", "step-50"]


def test_bad_calls():
    acc = Accelerator()
    with pytest.raises(ValueError, match="register_for_checkpointing: int has no state_dict"):
        acc.register_for_checkpointing(3)
    with pytest.raises(CheckpointError, match="is not a folder"):
        acc.load_state(Path("/nonexistent/ckpt"))


def test_export_a_transformers_model_for_from_pretrained(tmp_path):
    import transformers

    from meshfit.cli.main import main
    from reference import hf_llama

    acc = Accelerator()
    model = acc.prepare(hf_llama(n_layer=1, dtype=torch.float32))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, 256, (2, 8))
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    acc.save_state(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, model(input_ids=x).logits,
                                   rtol=0, atol=0)


def test_export_refuses_hf_for_other_models(saved, tmp_path, capsys):
    from meshfit.cli.main import main

    folder, _ = saved
    assert main(["export", str(folder), str(tmp_path / "hf"), "--to", "hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--to hf needs a checkpoint of a transformers model" in err[0]
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err


def test_sigkill_at_any_moment_of_saving_leaves_complete_checkpoints_loadable(tmp_path):
    """20 processes each saving checkpoint after checkpoint (and pruning), killed with SIGKILL
    at a random moment: every checkpoint `list_complete` finds still verifies and loads, the
    newest one included, and half-written folders are never among them."""
    import random
    import signal
    import time

    acc, net, _ = _prepared()
    root = tmp_path / "ckpts"
    rng = random.Random(0)
    interrupted = 0
    for trial in range(20):
        pid = os.fork()  # a copy of this process, with the prepared objects, saving
        if pid == 0:
            try:
                step = 100 * trial
                while True:
                    step += 1
                    acc.save_state(root / f"step-{step}", step=step)
                    prune(root, keep=2)
                    (tmp_path / f"saved-{trial}").touch()  # (one save done: kill any time)
            except BaseException as err:  # (a save that fails is a finding, not a kill)
                (tmp_path / f"error-{trial}.txt").write_text(f"{type(err).__name__}: {err}")
            finally:
                os._exit(0)
        # The random moment counts from the child's first complete save: on a loaded
        # machine a fork of a large process can take longer than the window to save once.
        deadline, ended = time.monotonic() + 120, False
        while not (tmp_path / f"saved-{trial}").exists() and time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                ended = True  # (it failed: its error file says why)
                break
            time.sleep(0.005)
        if not ended:
            time.sleep(rng.uniform(0.0, 0.25))
            os.kill(pid, signal.SIGKILL)  # our own child, by its PID
            os.waitpid(pid, 0)
        interrupted += any(root.glob("step-*.tmp-*"))
        for _, folder in list_complete(root):
            fresh, _, _ = _prepared()
            assert fresh.load_state(folder).step == int(folder.name.split("-")[1])
    errors = [p.read_text() for p in sorted(tmp_path.glob("error-*.txt"))]
    assert errors == []
    assert latest(root) is not None and interrupted >= 5  # saves were cut in the middle


def _edit_manifest(folder, **changes):
    import json

    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_a_manifest_that_disagrees_with_its_folder_name_or_its_data_is_refused(saved, tmp_path):
    """What a checkpoint says about itself must agree with its name (step-<N>) and with the
    step saved inside its checksummed data: an edited manifest is refused in one line, and
    `latest` passes over it, saying why (`skipped`)."""
    from meshfit.checkpoint import skipped

    folder, _ = saved  # saved at step 1, in a folder not named by its step
    _edit_manifest(folder, step=40)
    _refused(folder, r"ckpt: manifest.json says step 40, the checkpoint's data says step 1; "
                     "the manifest was edited")
    root = tmp_path / "run"
    root.mkdir()
    named = root / "step-1"
    shutil.copytree(folder, named)  # its manifest still says 40
    _refused(named, r"step-1: its manifest says step 40, its name step 1")
    assert latest(root) is None
    assert skipped(root) == [(named, "its manifest says step 40")]


def test_skipped_checkpoints_say_why(saved, tmp_path):
    """A checkpoint missing a shard, its .metadata or its manifest is passed over by `latest`
    and `meshfit train --resume` names it and the reason."""
    from meshfit.checkpoint import skipped
    from meshfit.train.run import find_checkpoint

    folder, _ = saved
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    for step, remove in ((1, None), (2, "__0_0.distcp"), (3, ".metadata"), (4, "manifest.json")):
        target = root / f"step-{step}"
        shutil.copytree(folder, target)
        _edit_manifest(target, step=step)  # (named by its step, as meshfit train names them)
        if remove:
            (target / remove).unlink()
    assert latest(root) == root / "step-1"
    reasons = dict((p.name, why) for p, why in skipped(root))
    assert reasons == {"step-2": "1 of its 2 files missing: __0_0.distcp",
                       "step-3": "1 of its 2 files missing: .metadata",
                       "step-4": "no manifest.json; it is not a complete meshfit checkpoint (a "
                                 "save that was interrupted leaves none)"}
    shutil.rmtree(root / "step-1")
    with pytest.raises(ValueError, match=r"holds no complete checkpoint \(skipped step-4: no "
                                         r"manifest.json.*; step-3: 1 of its 2 files missing"):
        find_checkpoint(root)


@pytest.mark.parametrize("failure", ["read-only", "disk full"])
def test_a_save_that_cannot_be_written_is_one_line_and_leaves_nothing(failure, tmp_path,
                                                                     monkeypatch):
    """A read-only file system (the folder cannot be made) or a full disk (DCP fails while
    writing, with the disk nearly full): one CheckpointError naming the checkpoint, no
    temporary folder left, and the checkpoints before it untouched."""
    import errno

    import torch.distributed.checkpoint as dcp

    from meshfit.checkpoint import save as saving

    acc, net, _ = _prepared()
    acc.save_state(tmp_path / "step-1", step=1)
    if failure == "read-only":
        def mkdir(self, *args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(self))

        monkeypatch.setattr(Path, "mkdir", mkdir)
        wanted = r"cannot write the checkpoint .*step-2 \(Read-only file system\)"
    else:
        def save(*args, **kwargs):
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")

        monkeypatch.setattr(dcp, "save", save)
        monkeypatch.setattr(saving.shutil, "disk_usage",
                            lambda p: type("u", (), {"free": 12 << 20})())
        wanted = r"cannot write the checkpoint .*step-2 \(the disk is full: 12.0 MiB free\)"
    with pytest.raises(CheckpointError, match=wanted) as err:
        acc.save_state(tmp_path / "step-2", step=2)
    assert "\n" not in str(err.value)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    assert latest(tmp_path) == tmp_path / "step-1"


def test_unfinished_saves_are_removed_when_the_job_ends(saved, tmp_path, capsys):
    """What a save stopped half-way leaves (a second signal, a killed rank, a full disk) is
    removed by `meshfit train` once the job's processes are gone: a temporary folder goes
    (named on stderr); a checkpoint renamed aside to be replaced comes back when its
    replacement never arrived, and goes when it did."""
    from meshfit.cli.launch import _remove_unfinished_saves

    folder, _ = saved
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    for name, step in (("step-4", 4), ("step-2.old-1a2b", 2), ("step-4.old-3c4d", 4)):
        shutil.copytree(folder, root / name)
        _edit_manifest(root / name, step=step)
    (root / "step-6.tmp-5e6f").mkdir()
    (root / "step-6.tmp-5e6f" / "__0_0.distcp").write_bytes(b"x" * 100)
    _remove_unfinished_saves(tmp_path / "run")
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4"]
    assert [s for s, _ in list_complete(root)] == [2, 4]
    assert capsys.readouterr().err == ("meshfit train: removed step-6.tmp-5e6f, a checkpoint "
                                       "save that did not finish\n")


def test_starting_a_run_does_not_import_dcp():
    """DCP (0.3 s of imports per process) is imported at the first save or load, not when
    the trainer and the Accelerator are: `meshfit train`'s start stays as fast as torchrun's."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import meshfit, meshfit.train.trainer, meshfit.accelerator.state\n"
            "import meshfit.checkpoint, meshfit.checkpoint.store, meshfit.checkpoint.save\n"
            "import meshfit.checkpoint.load, meshfit.checkpoint.manifest\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[-1] == "[]"


def test_a_background_save_whose_writer_died_is_one_line_and_the_next_save_works(
        tmp_path, monkeypatch):
    """A background save whose writer failed (a writer process ended by a signal): waiting for
    it raises one CheckpointError naming the checkpoint, its temporary folder is removed, the
    checkpoints before it are untouched, and the state saved next, from memory, loads."""
    from concurrent.futures import Future

    from meshfit.accelerator import state as accstate

    acc, net, _ = _prepared()
    acc.save_state(tmp_path / "before")
    real = accstate.save_dcp_async

    def dying(state, folder, **kwargs):
        tmp, future = real(state, folder, **kwargs)
        future.result()
        dead: Future = Future()
        dead.set_exception(RuntimeError("Checkpoint background process is dead. Exit code: -15"))
        return tmp, dead

    monkeypatch.setattr(accstate, "save_dcp_async", dying)
    acc.save_state(tmp_path / "after", async_save=True)
    with pytest.raises(CheckpointError, match=r"^the background save of \S+after failed on "
                                              r"rank 0 \(RuntimeError: Checkpoint background "
                                              r"process is dead. Exit code: -15\); it was "
                                              r"removed, the checkpoints before it are "
                                              r"untouched$"):
        acc.wait_for_checkpoint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["before"]
    assert acc.checkpoint_in_flight is None
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    acc.save_state(tmp_path / "again")
    fresh, fresh_net, _ = _prepared()
    fresh.load_state(tmp_path / "again")
    assert all(torch.equal(fresh_net.state_dict()[k], v) for k, v in weights.items())
