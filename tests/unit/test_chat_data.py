"""Chat / instruction data (issue 20, check 4): labels are -100 on every token the assistant did not write
(hand-checked on a 3-turn conversation, for a ChatML (Qwen-style) and a Llama-3-style template), packed and
padded rows, and the training loss equals a cross-entropy over assistant tokens computed by hand from the
model's logits on each conversation alone. Also: tokenizers from Hugging Face model folders (eos_token
``<|im_end|>`` / ``<|eot_id|>``) for text and chat data, refusals as one line, and resumable loading.

The tokenizers are the bundled GPT-2 one copied to a temporary folder with the chat special tokens added and a
chat template (in ``tokenizer_config.json`` or ``chat_template.jinja``) next to a ``config.json``.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from tokenizers import AddedToken, Regex, Tokenizer, pre_tokenizers

from kempnerforge.config import ModelConfig
from kempnerforge.data.chat_datamodule import ChatDataModule
from kempnerforge.data.chat_dataset import ChatDataset, pack_best_fit
from kempnerforge.data.chat_prepare import prepare_chat_data
from kempnerforge.data.chat_template import ChatDataError, load_chat_tokenizer, tokenize_conversations
from kempnerforge.data.memmap import MemmapTokenDataset, TokenDataError
from kempnerforge.data.prepare import prepare_data
from kempnerforge.data.prepare_cli import prepare_main
from kempnerforge.errors import UserError
from kempnerforge.module import CausalLM
from kempnerforge.training.lr import SchedulerConfig

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

REPO = Path(__file__).resolve().parents[2]
GPT2 = REPO / "data" / "tokenizers" / "gpt2"
IGNORE = -100

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 3.0's own template (the 3.1+ ones add a dated system header; the prefix method is indifferent to it).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# ChatML with Hugging Face's generation markers: transformers computes the assistant mask itself.
CHATML_MARKED = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
)
# Qwen-3-like: the last assistant turn gets an (empty) reasoning block, earlier ones lose it: not prefix-stable.
THINKING = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == 'assistant' "
    "and loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{{ message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

THREE_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},
]
# The rendered text of THREE_TURNS, written out by hand, each piece marked True where the assistant wrote it.
HAND = {
    "chatml": [
        (
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
            False,
        ),
        ("Hello!<|im_end|>", True),
        ("\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", False),
        ("4.<|im_end|>", True),
        ("\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n", False),
        ("You're welcome.<|im_end|>", True),
        ("\n", False),
    ],
    "llama3": [
        (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
            False,
        ),
        ("Hello!<|eot_id|>", True),
        (
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            False,
        ),
        ("4.<|eot_id|>", True),
        (
            "<|start_header_id|>user<|end_header_id|>\n\nThanks<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
            False,
        ),
        ("You're welcome.<|eot_id|>", True),
    ],
}
OTHERS = [
    [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes."}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."},
    ],
    [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two, three, four, five."}],
    [{"role": "user", "content": "Hello there, how are you today?"}, {"role": "assistant", "content": "Well, thanks."}],
]


def make_tokenizer(root: Path, style: str, template: str | None = None) -> Path:
    """GPT-2 with chat special tokens and a template, laid out as an HF model folder (config.json beside)."""
    folder = root / style
    folder.mkdir(parents=True)
    tok = Tokenizer.from_file(str(GPT2 / "tokenizer.json"))
    llama = style.startswith("llama3")
    names = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"] if llama else []
    names = names or ["<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    if llama:  # Llama 3's pre-tokenizer (newline runs are one piece), on GPT-2's byte-level BPE
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>"}
    config |= {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"} if llama else {"eos_token": "<|im_end|>"}
    template = template if template is not None else (LLAMA3 if llama else CHATML)
    if llama:  # transformers 5's layout: the template in its own file
        (folder / "chat_template.jinja").write_text(template)
    elif template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 50304}))
    return folder


def write_jsonl(path: Path, conversations: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(conversations)))
    return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {style: make_tokenizer(root, style) for style in ("chatml", "llama3")}


@pytest.fixture(scope="module")
def prepared(tokenizers, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    src = write_jsonl(root / "chat.jsonl", [THREE_TURNS, *OTHERS])
    out = {}
    for style, tok in tokenizers.items():
        out[style] = root / style
        prepare_main(["--source", str(src), "--tokenizer", str(tok), "--output_dir", str(out[style])]
                     + ["--format", "chat", "--progress", "false"])  # fmt: skip
    return out


def hand_expected(style: str, folder: Path) -> tuple[list[int], list[int]]:
    """Ids and shifted labels of THREE_TURNS from the hand-written pieces (the tokenizers library, no template)."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids, trained = [], []
    for text, is_assistant in HAND[style]:
        piece = tok.encode(text, add_special_tokens=False).ids
        ids += piece
        trained += [is_assistant] * len(piece)
    full = tok.encode("".join(t for t, _ in HAND[style]), add_special_tokens=False).ids
    assert ids == full  # the pieces tokenize as the whole text does
    labels = [ids[t + 1] if trained[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]
    return ids, labels


@pytest.mark.parametrize("style", ["chatml", "llama3"])
@pytest.mark.parametrize("packing", [True, False])
def test_labels_are_ignored_on_every_non_assistant_token_of_a_three_turn_conversation(
    prepared, tokenizers, style, packing
):
    ids, labels = hand_expected(style, tokenizers[style])
    n = len(ids)
    data = ChatDataset(prepared[style], seq_len=96, packing=packing)
    row = data[0]  # conversation 0 is the longest: first in the first packed row, and row 0 when padded
    assert row["input_ids"][:n].tolist() == ids
    assert row["labels"][:n].tolist() == labels
    trained = Tokenizer.from_file(str(tokenizers[style] / "tokenizer.json")).decode(
        [x for x in labels if x != IGNORE], skip_special_tokens=False
    )
    end = "<|eot_id|>" if style == "llama3" else "<|im_end|>"
    assert trained == f"Hello!{end}4.{end}You're welcome.{end}"
    if packing:
        doc = row["doc_ids"].tolist()
        assert doc[:n] == [0] * n and doc[n] == 1 and doc == sorted(doc)
        assert data.stats["rows"] < len(OTHERS) + 1  # several conversations share rows
    else:
        assert "doc_ids" not in row
        assert row["labels"][n:].eq(IGNORE).all() and row["input_ids"][n:].eq(50256).all()  # pad_token
    # Every assistant target of the data set is in some row exactly once.
    meta = json.loads((prepared[style] / "metadata.json").read_text())
    assert sum(int(data[i]["labels"].ne(IGNORE).sum()) for i in range(len(data))) == meta["num_target_tokens"]


def test_generation_markers_give_the_same_mask_as_prefix_rendering(tmp_path):
    """transformers' own assistant mask (``{% generation %}`` markers) is the oracle of the prefix-diff method."""
    plain = load_chat_tokenizer(str(make_tokenizer(tmp_path, "chatml")))
    marked = load_chat_tokenizer(str(make_tokenizer(tmp_path / "m", "chatml", CHATML_MARKED)))
    assert marked.generation_markers and not plain.generation_markers
    conversations = [THREE_TURNS, *OTHERS]
    wheres = [f"conversation {i}" for i in range(len(conversations))]
    assert tokenize_conversations(marked, conversations, wheres) == tokenize_conversations(plain, conversations, wheres)


class _Snapshot(Callback):
    """Keeps the first training batch and a copy of the model before its optimizer step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch, self.model = {k: v.clone() for k, v in batch.items()}, copy.deepcopy(pl_module.model)


@pytest.mark.parametrize("packing", [True, False])
def test_training_loss_equals_assistant_token_cross_entropy_by_hand(prepared, tokenizers, tmp_path, packing):
    """One step on a batch holding every conversation: the logged loss is the mean cross-entropy over the assistant
    tokens, computed here per conversation (each alone, unpacked, unpadded) from the model's logits."""
    data_dir = prepared["chatml"]
    rows = len(ChatDataset(data_dir, seq_len=96, packing=packing))
    dm = ChatDataModule(str(data_dir), seq_len=96, micro_batch_size=rows, packing=packing, vocab_size=50304)
    module = CausalLM(
        ModelConfig(
            dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50304, max_seq_len=96, multiple_of=16, init_std=0.2
        ),
        scheduler=SchedulerConfig(warmup_steps=1, total_steps=1),
    )
    snap = _Snapshot()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, callbacks=[snap],
                      default_root_dir=str(tmp_path))  # fmt: skip
    trainer.fit(module, dm)
    assert ("doc_ids" in snap.batch) == packing and (rows < 6) == packing  # packed: conversations share rows
    tok = load_chat_tokenizer(str(tokenizers["chatml"]))
    conversations = [THREE_TURNS, *OTHERS]
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for ids, mask in tokenize_conversations(tok, conversations, [""] * len(conversations)):
            logits = snap.model(torch.tensor([ids]))[0].double()
            target = torch.tensor(ids[1:])
            keep = torch.tensor(mask[1:])
            total += F.cross_entropy(logits[:-1][keep], target[keep], reduction="sum")
            count += int(keep.sum())
    assert int(snap.batch["labels"].ne(IGNORE).sum()) == count
    torch.testing.assert_close(trainer.callback_metrics["train/loss"].double(), total / count, rtol=1e-6, atol=1e-6)


def test_best_fit_packing_keeps_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=500)
    bins = pack_best_fit(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert max(int(lengths[b].sum()) for b in bins) <= 128
    assert len(bins) <= int(np.ceil(lengths.sum() / 128 * 1.05))  # within 5% of the lower bound
    assert pack_best_fit(np.array([5, 3, 4, 2]), 7) == [[0, 3], [2, 1]]


def test_overlong_conversations_are_truncated_or_dropped(prepared, tokenizers):
    ids, labels = hand_expected("chatml", tokenizers["chatml"])
    cut = ChatDataset(prepared["chatml"], seq_len=30, packing=False)
    assert cut.stats["truncated"] == 2 and cut.stats["dropped"] == 0
    assert cut[0]["input_ids"].tolist() == ids[:30]
    assert cut[0]["labels"].tolist() == labels[:29] + [IGNORE]
    dropped = ChatDataset(prepared["chatml"], seq_len=30, packing=False, overlong="drop")
    assert dropped.stats["dropped"] == cut.stats["truncated"] and len(dropped) == len(cut) - cut.stats["truncated"]
    # Cut before the first assistant token: nothing left to train on, so the conversation is dropped.
    # (The 3-turn conversation's first target is token 20, the 4th conversation's token 23.)
    none_left = ChatDataset(prepared["chatml"], seq_len=20, packing=True)
    assert (none_left.stats["dropped"], none_left.stats["truncated"], none_left.stats["conversations"]) == (2, 2, 4)


def test_worker_processes_write_the_same_shards(tokenizers, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [THREE_TURNS, *OTHERS] * 20)
    one = prepare_chat_data(str(src), str(tokenizers["llama3"]), str(tmp_path / "a"), batch_size=16, progress=False)
    two = prepare_chat_data(str(src), str(tokenizers["llama3"]), str(tmp_path / "b"), batch_size=16, progress=False,
                            num_proc=2)  # fmt: skip
    assert one["shards"] == two["shards"] and one["num_conversations"] == 120
    for key in ("file", "mask_file", "offsets_file"):
        name = one["shards"][0][key]
        assert np.array_equal(np.load(tmp_path / "a" / name), np.load(tmp_path / "b" / name))


def test_an_inconsistent_chat_folder_is_refused(prepared, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(prepared["chatml"], broken)
    np.save(broken / "offsets_00000.npy", np.load(broken / "offsets_00000.npy")[:-1])
    with pytest.raises(TokenDataError, match="offsets_00000.npy does not match metadata.json"):
        ChatDataset(broken, seq_len=64)
    shutil.copy(prepared["chatml"] / "offsets_00000.npy", broken)
    np.save(broken / "mask_00000.npy", np.load(broken / "mask_00000.npy")[:-1])
    with pytest.raises(TokenDataError, match="mask entries, but metadata.json says"):
        ChatDataset(broken, seq_len=64)[0]


def test_a_folder_of_jsonl_files_and_another_messages_field(prepared, tokenizers, tmp_path):
    (tmp_path / "src" / "b").mkdir(parents=True)
    for name, convs in (("a.jsonl", [THREE_TURNS, *OTHERS[:2]]), ("b/c.jsonl", OTHERS[2:])):
        (tmp_path / "src" / name).write_text("".join(json.dumps({"conv": c}) + "\n\n" for c in convs))  # blank lines
    meta = prepare_chat_data(
        str(tmp_path / "src"), str(tokenizers["chatml"]), str(tmp_path / "o"), "conv", progress=False
    )
    ref = json.loads((prepared["chatml"] / "metadata.json").read_text())
    assert meta["shards"] == ref["shards"]  # same conversations in the same order as the one-file source
    with pytest.raises(ChatDataError, match="has no 'messages' field"):
        prepare_chat_data(str(tmp_path / "src"), str(tokenizers["chatml"]), str(tmp_path / "p"), progress=False)


def test_text_and_chat_folders_refuse_each_other(prepared, tmp_path):
    with pytest.raises(TokenDataError, match="holds chat data"):
        MemmapTokenDataset(prepared["chatml"], seq_len=16)
    (tmp_path / "a.txt").write_text("some text " * 50)
    prepare_data(str(tmp_path / "a.txt"), str(GPT2), str(tmp_path / "text"), progress=False)
    with pytest.raises(TokenDataError, match="not chat data"):
        ChatDataset(tmp_path / "text", seq_len=16)


@pytest.mark.parametrize("style,eos", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_prepare_data_takes_a_model_folder_tokenizer(tokenizers, tmp_path, style, eos):
    """Text data with an instruct model's folder: documents end with its eos_token, ids are the tokenizer's."""
    folder = tokenizers[style]
    (tmp_path / "a.txt").write_text("To be, or not to be.")
    meta = prepare_data(str(tmp_path / "a.txt"), str(folder), str(tmp_path / "out"), progress=False)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert meta["eos_id"] == tok.token_to_id(eos) and meta["vocab_size"] == tok.get_vocab_size()
    stored = np.load(tmp_path / "out" / meta["shards"][0]["file"]).tolist()
    assert stored == tok.encode("To be, or not to be.", add_special_tokens=False).ids + [meta["eos_id"]]


def test_chat_loader_resumes_exactly(prepared):
    def loader():
        return ChatDataModule(str(prepared["llama3"]), seq_len=64, micro_batch_size=1, data_seed=5).train_dataloader()

    ref = [b["input_ids"].tolist() for b in loader()]
    first = loader()
    it = iter(first)
    head = [next(it)["input_ids"].tolist() for _ in range(2)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + [b["input_ids"].tolist() for b in resumed] == ref and len(ref) > 3


BAD_LINES = {
    "not JSON": ('{"messages": [}\n', "data.source", r"line 2 is not JSON"),
    "no messages": (
        '{"conversation": []}\n',
        "data.source",
        r"line 2 has no 'messages' field \(has \['conversation'\]\)",
    ),
    "unknown role": (
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}) + "\n",
        "data.source",
        r"line 2: messages\[1\]\.role='robot' is not one of system, user, assistant, tool",
    ),
    "no assistant": (
        json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n",
        "data.source",
        "nothing to train",
    ),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_records_are_refused_naming_file_and_line(tokenizers, tmp_path, case):
    line, field, message = BAD_LINES[case]
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"messages": OTHERS[0]}) + "\n" + line)
    dm = ChatDataModule(str(tmp_path / "out"), source=str(src), tokenizer=str(tokenizers["chatml"]))
    with pytest.raises(UserError, match=message) as err:
        dm.check_source()
    assert err.value.field == field and str(src) in str(err.value)


def test_bad_tokenizers_and_templates_are_refused(tokenizers, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [THREE_TURNS])
    with pytest.raises(UserError, match="has no chat template") as err:
        ChatDataModule(str(tmp_path / "out"), source=str(src), tokenizer=str(GPT2))
    assert err.value.field == "data.tokenizer"
    with pytest.raises(UserError, match="does not exist") as err:
        ChatDataModule(
            str(tmp_path / "out"), source=str(tmp_path / "missing.jsonl"), tokenizer=str(tokenizers["chatml"])
        ).check_source()
    assert err.value.field == "data.source"
    thinking = make_tokenizer(tmp_path, "thinking", THINKING)
    single = write_jsonl(tmp_path / "single.jsonl", OTHERS[:2])
    prepare_chat_data(str(single), str(thinking), str(tmp_path / "ok"), progress=False)  # one turn: prefix-stable
    with pytest.raises(
        ChatDataError, match=r"chat template in .*thinking/tokenizer_config.json renders messages\[:3\]"
    ):
        prepare_chat_data(str(src), str(thinking), str(tmp_path / "no"), progress=False)


def test_a_template_that_raises_and_a_text_folder_are_refused(prepared, tmp_path):
    strict = make_tokenizer(
        tmp_path, "strict", CHATML.replace("{% for", "{{ raise_exception('roles must alternate') }}{% for")
    )
    src = write_jsonl(tmp_path / "c.jsonl", OTHERS[:1])
    with pytest.raises(ChatDataError, match=r"c.jsonl line 1: the chat template in .*strict.* refuses it: roles must"):
        prepare_chat_data(str(src), str(strict), str(tmp_path / "out"), progress=False)
    (tmp_path / "a.txt").write_text("some text " * 50)
    prepare_data(str(tmp_path / "a.txt"), str(GPT2), str(tmp_path / "text"), progress=False)
    with pytest.raises(UserError, match="not chat data") as err:
        ChatDataModule(str(tmp_path / "text")).check_source()
    assert err.value.field == "data.data_dir"
    ChatDataModule(str(prepared["chatml"])).check_source()  # a chat folder passes


def test_prepare_data_cli_prints_one_line(tokenizers, tmp_path, capsys):
    """A bad record after good ones (all checked before rendering: no progress bar line first) and a bad --format."""
    src = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    src.write_text(f'{good}\n{good}\n{{"messages": 3}}\n')
    for fmt, want in (("chat", f"--source: {src} line 3: messages must be a non-empty list"), ("chatml", "--format: ")):
        with pytest.raises(SystemExit) as exit_:
            prepare_main(["--source", str(src), "--tokenizer", str(tokenizers["chatml"]),
                          "--output_dir", str(tmp_path / "o"), "--format", fmt])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1, err
        assert err[0].startswith(f"kforge: error: {want}"), err
        assert not (tmp_path / "o").exists()  # refused before anything was written
