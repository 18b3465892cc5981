"""The README's and the user guide's code runs (issue 29.4): every fenced block of README.md and
docs/user-guide.md carries a marker on the line before it, `<!-- docs-test: NAME -->`, and NAME is
either run here, extracted from the Markdown as it stands (so the docs cannot drift from the code),
or listed in NOT_RUN with the reason (shown as a skip). Blocks that are fragments run inside a small
declared context: a prelude that defines what the block assumes (`model`, `train_loader`, ...), and
a postlude that checks what the block promises. Multi-rank blocks run as scripts on 2 CPU ranks,
started the way the block starts them (Lightning's launcher re-running the script)."""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys
import textwrap
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from lightning_zero3 import ZeRO3Strategy
from lightning_zero3.common.options import LightningOptions
from lightning_zero3.engine import ShardingConfig
from tests.support.processes import ROOT, job_env

DOCS = ("README.md", "docs/user-guide.md")
MARKER = re.compile(r"^(?P<indent> *)<!-- docs-test: (?P<name>[\w-]+) -->\n(?P=indent)```(?P<lang>\w*)\n", re.M)
FENCE = re.compile(r"^ *```", re.M)


@dataclass(frozen=True)
class Block:
    name: str
    file: str
    line: int
    lang: str
    code: str


def _blocks() -> dict[str, Block]:
    found: dict[str, Block] = {}
    for doc in DOCS:
        text = (Path(ROOT) / doc).read_text()
        for match in MARKER.finditer(text):
            indent, start = match["indent"], match.end()
            end = text.index(f"\n{indent}```", start - 1)
            code = textwrap.dedent(text[start:end + 1])
            line = text.count("\n", 0, match.start()) + 1
            assert match["name"] not in found, f"{doc}:{line}: docs-test name {match['name']} used twice"
            found[match["name"]] = Block(match["name"], doc, line, match["lang"], code)
    return found


BLOCKS = _blocks()
NOT_RUN = {
    "guide-install": "installs packages from the network; the README's first two lines are the same commands",
    "guide-use": "CUDA: its second Trainer has accelerator='gpu', devices=8, num_nodes=2",
    "guide-compile": "compiles with inductor (a C++ toolchain, minutes on CPU); tests/engine/test_engine_compile.py "
    "fits block.compile(fullgraph=True) in configure_model() with aot_eager",
    "readme-example-output": "the output of a run of examples/train_gpt.py (figures of commit b68a009), not code",
}


def test_every_fenced_block_of_the_docs_is_marked_and_either_run_or_listed() -> None:
    for doc in DOCS:
        lines = (Path(ROOT) / doc).read_text().splitlines()
        fences = [n for n, line in enumerate(lines) if FENCE.match(line)]
        unmarked = [n + 1 for n in fences[::2] if not lines[n - 1].strip().startswith("<!-- docs-test: ")]
        assert not unmarked, f"{doc}: fenced blocks at lines {unmarked} have no <!-- docs-test: NAME --> marker"
    ran = {name for name, value in globals().items() if name.startswith("test_block_")} | set(RUN_TOGETHER)
    assert set(NOT_RUN) | set(RUN_TOGETHER) <= set(BLOCKS), sorted(set(NOT_RUN) | set(RUN_TOGETHER) - set(BLOCKS))
    untested = [n for n in BLOCKS if n not in set(NOT_RUN) | ran and f"test_block_{n.replace('-', '_')}" not in ran]
    assert not untested, f"blocks with neither a test_block_* test nor a NOT_RUN reason: {untested}"


@pytest.mark.parametrize("name", sorted(NOT_RUN))
def test_block_listed_as_not_run(name: str) -> None:
    pytest.skip(f"{BLOCKS[name].file}:{BLOCKS[name].line} {name}: {NOT_RUN[name]}")


# ---- running a block as a script on 2 ranks --------------------------------------------------
MODULE = '''
import json, os
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
import lightning as L
import lightning_zero3


class MyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.layer(x))


class MyLightningModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([MyBlock() for _ in range(2)])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        return self(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


torch.manual_seed(0)
train_loader = DataLoader(torch.randn(32, 16), batch_size=4)
'''


def _report() -> str:
    """Postlude helper: each rank writes `seen` (a dict the postlude fills) to rank{r}.json."""
    return "\nimport torch.distributed as _dist\n" \
        "open(f'rank{_dist.get_rank()}.json', 'w').write(json.dumps(seen))\n"


@dataclass(frozen=True)
class Section:
    """One block of a script: `prelude` (what the block assumes; with `inside`, the block itself
    too), the block `name`, then `postlude` (its checks, ending in `_report()`)."""

    name: str
    prelude: str
    postlude: str
    inside: bool = False

    def code(self) -> str:
        block = "" if self.inside else BLOCKS[self.name].code
        return f"{self.prelude}\n# ---- the block {self.name} ----\n{block}\n# ---- its checks ----\n{self.postlude}"


def _run_script(tmp_path: Path, sections: list[Section]) -> dict[str, list[dict]]:
    """`sections` one after another after MODULE, as `python blocks.py` in `tmp_path` on 2 ranks
    (one launch: each extra rank re-runs the script), each in a directory of its own named after
    its block (its files land there); returns each section's rank{r}.json of every rank."""
    here = "_HERE = os.path.dirname(os.path.abspath(__file__))\n"
    parts = [MODULE, here]
    for section in sections:
        directory = f"os.path.join(_HERE, {section.name!r})"
        enter = f"\nos.makedirs({directory}, exist_ok=True)\nos.chdir({directory})\n"
        parts += [enter, section.code(), "os.chdir(_HERE)\n"]
    script = tmp_path / "blocks.py"
    script.write_text("\n".join(parts))
    done = subprocess.run([sys.executable, str(script)], env=job_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    names = ", ".join(f"{BLOCKS[s.name].file}:{BLOCKS[s.name].line} {s.name}" for s in sections)
    assert done.returncode == 0, f"{script} ({names}):\n{done.stderr[-4000:]}"
    return {s.name: [json.loads((tmp_path / s.name / f"rank{r}.json").read_text()) for r in range(2)] for s in sections}


@pytest.fixture(scope="module")
def trainer_blocks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """The blocks that fit a Trainer, in one script: one launch of 2 ranks, not one a block."""
    return _run_script(tmp_path_factory.mktemp("trainer_blocks"), TRAINER_SECTIONS)


@pytest.fixture(scope="module")
def fabric_blocks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """The blocks that launch Fabric, in one script."""
    return _run_script(tmp_path_factory.mktemp("fabric_blocks"), FABRIC_SECTIONS)


QUICK_START = Section("readme-quick-start", "", '''
if __name__ == "__main__":
    seen = {"shapes": {k: list(v.shape) for k, v in weights.items()}, "options": trainer.strategy.config.prefetch}
''' + textwrap.indent(_report(), "    "))


@pytest.mark.slow
def test_block_readme_quick_start(trainer_blocks: dict[str, list[dict]]) -> None:
    """The quick start trains on 2 ranks and `full_state_dict()` gives rank 0 whole weights."""
    ranks = trainer_blocks["readme-quick-start"]
    assert ranks[0]["shapes"]["blocks.0.layer.weight"] == [16, 16] and ranks[0]["shapes"]["head.weight"] == [1, 16]
    assert ranks[1]["shapes"] == {} and ranks[0]["options"] == 2


README_FABRIC = Section("readme-fabric", '''
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y, loss_fn = torch.randn(4, 8), torch.randn(4, 1), F.mse_loss
''', '''
seen = {"shard": list(next(model.parameters()).shape), "saved": os.path.isdir("ckpt"), "step": optimizer.state != {}}
''' + _report())


@pytest.mark.slow
def test_block_readme_fabric(fabric_blocks: dict[str, list[dict]]) -> None:
    ranks = fabric_blocks["readme-fabric"]
    assert all(r["shard"] == [32] and r["saved"] and r["step"] for r in ranks)  # 8x8 weight: 64 / 2 ranks


GUIDE_FABRIC = Section("guide-fabric", '''
MyModel = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
loader = DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randint(0, 3, (16,))), batch_size=4)
''', '''
seen = {"steps": step + 1, "saved": os.path.isdir("ckpt")}
''' + _report())


@pytest.mark.slow
def test_block_guide_fabric(fabric_blocks: dict[str, list[dict]]) -> None:
    ranks = fabric_blocks["guide-fabric"]
    assert all(r == {"steps": 2, "saved": True} for r in ranks)  # 16 samples, 4 per batch, 2 ranks


STATS_MONITOR = Section("guide-stats-monitor", "\nmodel = MyLightningModule()\n", '''
import csv
rows = []
if trainer.global_rank == 0:
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        rows = [row for row in csv.DictReader(f) if row.get("zero3/all_gather_bytes")]
seen = {"steps": [int(row["step"]) for row in rows], "keys": sorted(rows[0]) if rows else []}
''' + _report())


@pytest.mark.slow
def test_block_guide_stats_monitor(trainer_blocks: dict[str, list[dict]]) -> None:
    """One row per optimizer step in the CSV logger's file, with the strategy's figures."""
    rank0 = trainer_blocks["guide-stats-monitor"][0]
    assert rank0["steps"] == list(range(20))  # at the steps Lightning logs `self.log` values at
    assert {"zero3/reduce_scatter_bytes_formula", "zero3/gather_wait_s", "zero3/rss_anon_bytes"} <= set(rank0["keys"])


AFTER_FIT_STATE_DICT = Section("guide-after-fit-state-dict", '''
model = MyLightningModule()
trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=2, max_steps=4, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
''', '''
seen = {}
if trainer.global_rank == 0:
    seen = {k: list(v.shape) for k, v in torch.load("weights.pt").items()}
''' + _report())


@pytest.mark.slow
def test_block_guide_after_fit_state_dict(trainer_blocks: dict[str, list[dict]]) -> None:
    """After fit, inside `gathered_parameters`, `model.state_dict()` is whole: rank 0 saves it."""
    rank0 = trainer_blocks["guide-after-fit-state-dict"][0]
    assert rank0 == {"blocks.0.layer.weight": [16, 16], "blocks.0.layer.bias": [16],
                     "blocks.1.layer.weight": [16, 16], "blocks.1.layer.bias": [16],
                     "head.weight": [1, 16], "head.bias": [1]}  # fmt: skip


GATHERED_STATE_DICT = Section("guide-gathered-state-dict", '''
from transformers import GPT2Config, GPT2LMHeadModel


class HFModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2))
        self.head = nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss + self.head.weight.sum() * 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
model = HFModule()
trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=2, max_steps=3, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(model, DataLoader(torch.randint(0, 32, (24, 8)), batch_size=4))
''', '''
seen = {"head": list(head.shape)}
with trainer.strategy.gathered_parameters(model):
    now = {k: v.clone() for k, v in model.state_dict().items()}
if trainer.global_rank == 0:
    saved = torch.load("model.pt")
    loaded = GPT2LMHeadModel.from_pretrained("out").state_dict()
    seen["shapes"] = sorted({k: list(v.shape) for k, v in saved.items() if k.startswith("head")}.items())
    seen["pretrained_equal"] = all(torch.equal(v, saved["model." + k]) for k, v in loaded.items())
    seen["reloaded_equal"] = all(torch.equal(now[k], saved[k]) for k in saved)
''' + _report())


@pytest.mark.slow
def test_block_guide_gathered_state_dict(trainer_blocks: dict[str, list[dict]]) -> None:
    """After fit, inside `gathered_parameters`: rank 0 saves the whole state dict, every rank
    clones a whole weight, rank 0 saves a Hugging Face model inside the LightningModule that
    `from_pretrained` loads, and rank 0's `load_state_dict` with `modifier_rank=0` leaves the
    weights whole and as saved (that rank 0's values win: tests/lightning/test_user_state_dict.py)."""
    ranks = trainer_blocks["guide-gathered-state-dict"]
    assert all(r["head"] == [3, 16] for r in ranks)
    assert ranks[0]["shapes"] == [["head.bias", [3]], ["head.weight", [3, 16]]]
    assert ranks[0]["pretrained_equal"] and ranks[0]["reloaded_equal"]


# ---- blocks run in this process ---------------------------------------------------------------
def test_the_readme_options_table_lists_every_option_with_its_default() -> None:
    """The table under README's "Options" has one row per option of the signature, defaults as
    the dataclasses declare them."""
    text = (Path(ROOT) / "README.md").read_text()
    table = text[text.index("| option | default | meaning |"):]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table[: table.index("\n\n")], re.M)
    options = [f for config in (ShardingConfig, LightningOptions) for f in fields(config)]
    assert sorted(name for name, _ in rows) == sorted(f.name for f in options)
    namespace = {"timedelta": __import__("datetime").timedelta}
    for name, shown in rows:
        default = next(f.default for f in options if f.name == name)
        assert default is not MISSING and eval(shown, namespace) == default, (name, shown, default)


def test_block_guide_weight_decay() -> None:
    """Weight decay chosen by name: the Linear weights decay, biases and norms do not."""
    module = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    scope = {"self": module, "nn": nn}
    exec(BLOCKS["guide-weight-decay"].code, scope)
    assert [id(p) for p in scope["decay"]] == [id(module[0].weight), id(module[2].weight)]
    assert len(scope["no_decay"]) == 4


def test_block_guide_muon() -> None:
    """The recipe's `configure_optimizers` puts the 2-D weights in Muon, the rest in AdamW (under
    the strategy, tests/engine/test_whole_matrices.py trains it)."""
    scope: dict = {"torch": torch}
    exec(BLOCKS["guide-muon"].code, scope)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    muon, adamw = scope["configure_optimizers"](module)
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert [id(p) for p in muon.param_groups[0]["params"]] == [id(module[0].weight), id(module[2].weight)]


def test_block_readme_cli_yaml(tmp_path: Path) -> None:
    """The YAML builds the Trainer's ZeRO3Strategy through LightningCLI, its options typed."""
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    config = tmp_path / "config.yaml"
    config.write_text(BLOCKS["readme-cli-yaml"].code)
    assert yaml.safe_load(config.read_text())["trainer"]["strategy"]["class_path"] == "lightning_zero3.ZeRO3Strategy"
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=["--config", str(config)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ZeRO3Strategy)
    assert strategy.config.prefetch == 2 and strategy.config.wrap_policy == {nn.TransformerEncoderLayer}
    assert strategy.config.reduce_dtype is torch.bfloat16 and strategy.lightning_options.state_dict_type == "full"
    assert strategy.lightning_options.timeout.total_seconds() == 600


def test_block_readme_example_usage(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every flag the README's synopsis of examples/train_gpt.py shows is one the script takes
    (its `--help`, from its own parser, in this process)."""
    shown = set(re.findall(r"--[\w-]+", BLOCKS["readme-example-usage"].code))
    example = runpy.run_path(str(Path(ROOT) / "examples" / "train_gpt.py"), run_name="train_gpt")
    monkeypatch.setattr(sys, "argv", ["train_gpt.py", "--help"])
    with pytest.raises(SystemExit):
        example["parse_args"]()
    taken = set(re.findall(r"--[\w-]+", capsys.readouterr().out)) - {"--help"}
    assert shown == taken, f"shown but not taken: {shown - taken}; taken but not shown: {taken - shown}"


# ---- blocks that live inside a LightningModule or a callback: one fit runs them all ------------
def _in_class(name: str, indent: int = 4) -> str:
    return textwrap.indent(BLOCKS[name].code, " " * indent)


HOOKS = '''
class TinyLM(nn.Module):
    """Token embedding, two blocks, a head; `generate` appends the greedy token."""

    def __init__(self, vocab=11, dim=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(2)])
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(x)

    def generate(self, input_ids, max_new_tokens):
        for _ in range(max_new_tokens):
            input_ids = torch.cat([input_ids, self(input_ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return input_ids


prompt = torch.tensor([[1, 2, 3]])


class Hooks(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = TinyLM()
        self.net = self.model  # the name the direct-call block uses

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self):
        trainer = self.trainer
{gathered}
        with trainer.strategy.gathered_parameters(self.model.wte):
            self.wte_row0 = self.model.wte.weight[0].abs().sum().item()

{grad_norm}

{predict}

{callback}

{sample}
'''


IN_ONE_FIT = Section("guide-gathered-parameters", HOOKS.format(
    gathered=_in_class("guide-gathered-parameters", 8), grad_norm=_in_class("guide-grad-norm"),
    predict=_in_class("guide-gathered-for-inference"), callback=BLOCKS["guide-callback-gathered"].code,
    sample=BLOCKS["guide-direct-call"].code,
) + '''
model = Hooks()
trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=2, max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, callbacks=[LogHeadNorm(), Sample()])
trainer.fit(model, DataLoader(torch.randint(0, 11, (16, 6)), batch_size=4))
metrics = dict(trainer.callback_metrics)  # predict clears them
predicted = trainer.predict(model, DataLoader(torch.randint(0, 11, (4, 3)), batch_size=2))
''', '''
seen = {"wte_row0": model.wte_row0, "head_norm": float(metrics["head_norm"]),
        "grad_total": "grad_2.0_norm_total" in metrics, "predicted": [list(p.shape) for p in predicted]}
''' + _report(), inside=True)


@pytest.mark.slow
def test_blocks_inside_a_lightning_module_run_in_one_fit(trainer_blocks: dict[str, list[dict]]) -> None:
    """guide-gathered-parameters (in `on_train_end`: rank 0's zeroed row kept on every rank),
    guide-grad-norm (logged), guide-callback-gathered (LogHeadNorm logs the whole head's norm),
    guide-direct-call (Sample generates in a callback), guide-gathered-for-inference (predict)."""
    for rank in trainer_blocks["guide-gathered-parameters"]:
        assert rank["wte_row0"] == 0.0 and rank["head_norm"] > 0 and rank["grad_total"]
        assert rank["predicted"] == [[2, 99]]  # 2 prompts of 3 tokens + 96 new, this rank's one batch


RUN_TOGETHER = {
    name: test_blocks_inside_a_lightning_module_run_in_one_fit
    for name in ("guide-gathered-parameters", "guide-grad-norm", "guide-callback-gathered", "guide-direct-call",
                 "guide-gathered-for-inference")
}  # fmt: skip


LORA = '''
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16)


class LoRA(L.LightningModule):
{lora}

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch, labels=batch).loss


model = LoRA()
trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=2, max_steps=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(model, DataLoader(torch.randint(0, 32, (16, 8)), batch_size=4))
'''


LORA_SECTION = Section("guide-lora", LORA.format(lora=_in_class("guide-lora")), '''
opt = trainer.optimizers[0]
seen = {"in_optimizer": sum(len(g["params"]) for g in opt.param_groups),
        "trainable": sum(p.requires_grad for p in model.parameters()), "step": trainer.global_step}
''' + _report(), inside=True)


@pytest.mark.slow
def test_block_guide_lora(trainer_blocks: dict[str, list[dict]]) -> None:
    """The peft model built in `__init__`, the optimizer over the trainable parameters only."""
    for rank in trainer_blocks["guide-lora"]:
        assert rank["step"] == 2 and 0 < rank["in_optimizer"] == rank["trainable"]


TRAINER_SECTIONS = [QUICK_START, STATS_MONITOR, AFTER_FIT_STATE_DICT, GATHERED_STATE_DICT, IN_ONE_FIT, LORA_SECTION]
FABRIC_SECTIONS = [README_FABRIC, GUIDE_FABRIC]
