"""Token files: the writer, the header's checks, the window order (stages, replicas, epochs, resume), memory."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.models.token_format import TokenFileInfo, header_path
from lightning_async_pp.models.token_writer import main as tokenize_main
from lightning_async_pp.models.token_writer import write_token_file
from lightning_async_pp.models.tokens import KeyedPermutation, TokenFileDataModule, TokenWindows, WindowSampler
from tests.fixtures.helpers import tiny_gpt
from tests.fixtures.token_files import position_file

# --- writing ----------------------------------------------------------------------------------------------------


def test_bytes_of_text_and_jsonl_documents_each_followed_by_end_of_text(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("héllo\nworld\n")
    (corpus / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 3}) + "\n")
    (corpus / "ignored.bin").write_bytes(b"\x00\x01")
    info = write_token_file([corpus], tmp_path / "train.bin")
    expected = [*"héllo\nworld\n".encode(), 256, *b"one", 256, *b"two", 256]  # sorted: a.txt, then b.jsonl
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist() == expected
    assert info == TokenFileInfo.read(tmp_path / "train.bin")
    assert (info.dtype, info.num_tokens, info.vocab_size, info.max_token_id) == ("uint16", len(expected), 257, 256)
    assert (info.eos_token_id, info.documents, info.tokenizer) == (256, 3, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "train.bin", "train.json"]  # no partial file


def test_a_long_text_file_is_written_in_pieces_with_one_end_of_text(tmp_path, monkeypatch):
    import lightning_async_pp.models.token_writer as writer

    monkeypatch.setattr(writer, "PIECE_CHARS", 64)  # many pieces from a small file
    text = "".join(f"line {i}\n" for i in range(200))
    (tmp_path / "long.txt").write_text(text)
    info = write_token_file([tmp_path / "long.txt"], tmp_path / "t.bin", dtype="uint32")
    assert np.fromfile(tmp_path / "t.bin", dtype=np.uint32).tolist() == [*text.encode(), 256]
    assert (info.dtype, info.documents) == ("uint32", 1)


def test_a_local_tokenizer_and_the_command(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    words = ["the", "pipeline", "stage", "sends", "[UNK]", "</s>"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>").save_pretrained(folder)
    lines = ["the pipeline sends", "the stage sends the stage"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    tokenize_main([str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "out.bin"), "--tokenizer", str(folder)])
    assert "Wrote" in capsys.readouterr().out
    reference = AutoTokenizer.from_pretrained(str(folder))
    expected = [i for t in lines for i in [*reference(t, add_special_tokens=False)["input_ids"], 5]]
    assert expected == [0, 1, 3, 5, 0, 2, 3, 0, 2, 5]
    assert np.fromfile(tmp_path / "out.bin", dtype=np.uint16).tolist() == expected
    assert TokenFileInfo.read(tmp_path / "out.bin").vocab_size == len(words)

    core_without_eos = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    core_without_eos.save_pretrained(tmp_path / "no_eos")
    with pytest.raises(ValueError, match="no end-of-text token"):
        write_token_file([tmp_path / "docs.jsonl"], tmp_path / "x.bin", tokenizer=tmp_path / "no_eos")
    assert not (tmp_path / "x.bin").exists()


def test_bad_sources_say_what_is_wrong(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"content": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1 has no string field"):
        write_token_file([tmp_path / "bad.jsonl"], tmp_path / "out.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no token file, no partial file
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_token_file([tmp_path / "missing.txt"], tmp_path / "out.bin")
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        write_token_file([tmp_path / "bad.jsonl"], tmp_path / "out.bin", tokenizer=tmp_path / "missing")


# --- the header's checks ----------------------------------------------------------------------------------------


def test_a_truncated_file_a_wrong_dtype_and_a_missing_header_are_refused(tmp_path):
    path = tmp_path / "train.bin"
    position_file(path, 1000)
    with open(path, "r+b") as file:
        file.truncate(1500)
    with pytest.raises(ValueError, match="holds 1,500 bytes, but its header gives 1,000 uint16 tokens"):
        TokenFileInfo.read(path)
    fields = json.loads(header_path(path).read_text())
    header_path(path).write_text(json.dumps({**fields, "dtype": "int64"}))
    with pytest.raises(ValueError, match="dtype 'int64'"):
        TokenFileInfo.read(path)
    header_path(path).write_text(json.dumps({**fields, "dtype": "uint32", "num_tokens": 1000}))
    with pytest.raises(ValueError, match="cut short"):  # 1500 bytes are not 1000 uint32 tokens either
        TokenFileInfo.read(path)
    header_path(path).unlink()
    with pytest.raises(FileNotFoundError, match="has no header"):
        TokenFileInfo.read(path)
    with pytest.raises(FileNotFoundError, match="tokenize SOURCE"):
        TokenFileInfo.read(tmp_path / "absent.bin")


def test_a_vocabulary_larger_than_the_models_is_refused(tmp_path):
    path = tmp_path / "train.bin"
    position_file(path, 600)
    data = TokenFileDataModule(str(path), block_size=8, batch_format="pairs")
    trainer = Trainer(logger=False, enable_progress_bar=False)
    trainer.strategy.connect(tiny_gpt(vocab_size=512))
    data.trainer = trainer
    with pytest.raises(ValueError, match="model's vocab_size is 512. Set the model's vocab_size to at least 600"):
        data.setup("fit")


def test_ids_above_the_headers_largest_stop_training_naming_file_offset_and_id(tmp_path):
    path = tmp_path / "train.bin"
    info = position_file(path, 60_000)  # ids up to 59,999 ...
    replace(info, vocab_size=257, max_token_id=256).write(path)  # ... under a header that says 256
    data = TokenFileDataModule(str(path), block_size=8, batch_size=4, batch_format="pairs", val_fraction=0)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AsyncPipelineStrategy(num_microbatches=2),
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=r"above the largest id its header .*train\.json gives") as error:
        trainer.fit(tiny_gpt(vocab_size=512), data)  # the header passes the vocabulary check: 257 <= 512
    found = re.search(
        r"Token file (\S+) holds id ([\d,]+) at token ([\d,]+), .*max_token_id 256, vocab_size 257", str(error.value)
    )
    assert found is not None, str(error.value)
    assert found[1] == str(path)
    # Token i of this file is id i: the offset named is where the id was read.
    assert found[2] == found[3] and int(found[2].replace(",", "")) > 256


# --- the order of the windows -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 65, 1000])
def test_the_keyed_permutation_is_a_permutation(size):
    orders = [[KeyedPermutation(size, seed)(i) for i in range(size)] for seed in range(3)]
    assert all(sorted(order) == list(range(size)) for order in orders)
    if size >= 7:
        assert orders[0] != orders[1] != orders[2] and orders[0] != sorted(orders[0])


def test_replicas_read_disjoint_windows_every_stage_the_same_and_each_epoch_another_order(tmp_path):
    """4096 tokens, windows of 16 + 1: per epoch, the windows of all replicas are distinct windows of the epoch's
    grid, equal on every stage (two samplers built alike), and epochs differ in offset or order."""
    info = position_file(tmp_path / "t.bin", 4096)
    data = TokenWindows(tmp_path / "t.bin", info, block_size=16, batch_format="pairs")
    orders = {}
    for epoch in range(3):
        shards = []
        for replica in range(2):
            stages = []
            for _ in range(2):  # two stages of the replica, each with its own sampler
                sampler = WindowSampler(data.num_tokens, 16, num_replicas=2, rank=replica, seed=5)
                sampler.set_epoch(epoch)
                stages.append(list(sampler))
            assert stages[0] == stages[1]
            shards.append(stages[0])
        starts = shards[0] + shards[1]
        assert len(shards[0]) == len(shards[1]) == (4096 - 16) // 16 // 2
        assert len(set(starts)) == len(starts)  # disjoint: no window twice, within or across replicas
        assert len({s % 16 for s in starts}) == 1 and max(starts) + 17 <= 4096  # one grid, inside the file
        for start in starts[:20]:  # a window is the tokens at its start (the file holds its positions)
            inputs, targets = data[start]
            assert inputs.tolist() == list(range(start, start + 16)) and targets[-1] == start + 16
        orders[epoch] = starts
    assert orders[0] != orders[1] != orders[2]


def test_validation_reads_the_tail_in_order_and_training_never_does(tmp_path):
    position_file(tmp_path / "t.bin", 4000)
    data = TokenFileDataModule(str(tmp_path / "t.bin"), val_fraction=0.1, block_size=32, batch_size=4)
    data.setup("fit")
    train = [b["input_ids"] for b in data.train_dataloader()]
    val = [b["input_ids"] for b in data.val_dataloader()]
    assert max(int(b.max()) for b in train) < 3600  # training stays before the held-out tail
    starts = [int(s) for b in val for s in b[:, 0]]
    assert starts == list(range(3600, 4000 - 32, 32)) and val[0].shape == (4, 33)
    assert len(train) == (3600 - 32) // 32 // 4


def test_samples_per_epoch_and_the_errors_of_the_sampler(tmp_path):
    assert len(WindowSampler(1000, 10, samples_per_epoch=40)) == 40
    assert len(WindowSampler(1000, 10, num_replicas=3, rank=2, samples_per_epoch=40)) == 13
    with pytest.raises(ValueError, match="between 1 and the 99 windows"):
        WindowSampler(1000, 10, samples_per_epoch=100)
    with pytest.raises(ValueError, match="smaller `block_size`"):
        WindowSampler(30, 16)
    position_file(tmp_path / "t.bin", 1000)
    with pytest.raises(ValueError, match="holds 10 tokens, fewer than one window .* Raise `val_fraction`"):
        TokenFileDataModule(str(tmp_path / "t.bin"), val_fraction=0.01, block_size=16).setup("fit")


# --- resuming mid-epoch -----------------------------------------------------------------------------------------


class BatchRecorder(Callback):
    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch[0].clone())


@pytest.fixture
def one_thread():
    # A model this small runs several times faster on one intra-op thread when the cores are shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fit(data, steps: int, tmp_path, ckpt_path=None, save_at: int | None = None) -> list[torch.Tensor]:
    recorder = BatchRecorder()
    callbacks = [recorder]
    if save_at is not None:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=save_at, save_top_k=-1))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AsyncPipelineStrategy(num_microbatches=2),
        max_steps=steps,
        logger=False,
        enable_checkpointing=save_at is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(tiny_gpt(vocab_size=2048, n_embd=16), data, ckpt_path=ckpt_path)
    return recorder.batches


def test_a_run_resumed_mid_epoch_reads_the_batches_of_the_uninterrupted_run(tmp_path, monkeypatch, one_thread):
    """4 batches per epoch, 10 steps straight against a resume from the checkpoint of step 6 (epoch 1, batch 2):
    the resumed run trains on the straight run's batches 6-9 and reads no window of the 6 batches before."""
    position_file(tmp_path / "t.bin", 2048)

    def make():
        return TokenFileDataModule(
            str(tmp_path / "t.bin"),
            val_fraction=0,
            block_size=16,
            batch_size=4,
            samples_per_epoch=16,
            batch_format="pairs",
            seed=3,
        )

    # The straight run saves at step 6 on its way, as a run stopped there would (epoch 1, batch 2).
    straight = _fit(make(), 10, tmp_path / "straight", save_at=6)
    epochs = [torch.cat(straight[:4]), torch.cat(straight[4:8])]
    for epoch in epochs:  # each epoch: 32 distinct windows of one grid, contiguous tokens
        starts = epoch[:, 0].tolist()
        assert len(set(starts)) == 16 and len({s % 16 for s in starts}) == 1
        assert torch.equal(epoch, epoch[:, :1] + torch.arange(16))
    assert not torch.equal(epochs[0], epochs[1])

    checkpoint = next((tmp_path / "straight").glob("*step=6*"))
    reads = []
    original = TokenWindows.__getitem__
    monkeypatch.setattr(TokenWindows, "__getitem__", lambda self, start: reads.append(start) or original(self, start))
    resumed = _fit(make(), 10, tmp_path / "second", ckpt_path=checkpoint)
    assert len(resumed) == 4
    for step, batch in enumerate(resumed, 6):
        assert torch.equal(batch, straight[step]), step
    assert len(reads) == 4 * 4  # the 6 trained batches were skipped without reading them


# --- memory -----------------------------------------------------------------------------------------------------


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _rss_growth(path, batches: int) -> int:
    before = _resident_bytes()
    data = TokenFileDataModule(str(path), val_fraction=0.001, block_size=64, batch_size=32)
    data.setup("fit")
    loader = data.train_dataloader()
    loader.sampler.set_epoch(1)
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    growth = _resident_bytes() - before
    del iterator, loader, data
    return growth


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_resident_memory_does_not_grow_with_the_file(tmp_path):
    """A 1M-token file and a 200M-token one (400 MB, sparse): building the module and reading 300 batches of
    32 x 65 tokens grows resident memory by the same few MB for both. Loading the big file would take 400 MB,
    a list of its 3.1M windows over 100 MB."""
    small, large = tmp_path / "small.bin", tmp_path / "large.bin"
    for path, tokens in ((small, 1_000_000), (large, 200_000_000)):
        with open(path, "wb") as file:
            file.truncate(tokens * 2)
        TokenFileInfo("uint16", tokens, vocab_size=257, max_token_id=256).write(path)
    _rss_growth(small, 20)  # warm-up: torch's and the collate's first allocations
    small_growth = _rss_growth(small, 300)
    large_growth = _rss_growth(large, 300)
    print(f"RSS growth: 1M tokens {small_growth / 2**20:.1f} MiB, 200M tokens {large_growth / 2**20:.1f} MiB")
    assert large_growth < small_growth + 8 * 2**20
    assert large_growth < 16 * 2**20


def test_the_llm_example_config_passes_the_cli_validation():
    import contextlib
    import io

    from lightning_async_pp.cli import main
    from tests.fixtures.helpers import ROOT

    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "examples" / "configs" / "llm_tokens.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
