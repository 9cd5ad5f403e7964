"""GradientScalingTrainer: ``transformers.Trainer.train()`` itself on a tiny BERT built from a config
(2 layers, hidden 64; no download), on a CPU in fp16 autocast, against the same Trainer with
``torch.amp.GradScaler("cpu")``: clipping, injected infs, gradient accumulation, checkpoint resume,
and ``hyperparameter_search``."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers.trainer
import wandb
from integration_helpers import InfInjector, OutputDtypes, fresh_accelerate_state
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback, TrainingArguments
from transformers import logging as transformers_logging
from transformers.hyperparameter_search import HyperParamSearchBackendBase
from transformers.trainer_utils import HPSearchBackend

from gs_lightning import GradientScaler
from gs_lightning.integrations import GradientScalingTrainer

pytestmark = pytest.mark.usefixtures(fresh_accelerate_state.__name__)
transformers_logging.set_verbosity_error()

SEQUENCE = 16


class TokenDataset(Dataset):
    """48 random sequences of 16 token ids with binary labels, as a tokenizer's output would be."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(1, 100, (48, SEQUENCE), generator=g)
        self.labels = torch.randint(0, 2, (48,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[i],
            "attention_mask": torch.ones(SEQUENCE, dtype=torch.long),
            "labels": self.labels[i],
        }


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=SEQUENCE,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def reference_scaler(model: Any) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu")


class StepRecorder(TrainerCallback):
    """Sets the injector's step at each optimizer step and records whether the Trainer's Accelerator saw it skipped."""

    def __init__(self, injector: InfInjector | None) -> None:
        self.injector = injector
        self.trainer: GradientScalingTrainer | None = None
        self.skipped: list[bool] = []

    def on_step_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self.injector is not None:
            self.injector.step = state.global_step

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self.skipped.append(self.trainer.accelerator.optimizer_step_was_skipped)


def make_trainer(
    output_dir: Path, make_scaler: Any = GradientScaler, inf_steps: tuple[int, ...] = (), **arguments: Any
) -> tuple[GradientScalingTrainer, StepRecorder]:
    model = tiny_bert()
    injector = InfInjector(model.bert.encoder.layer[1].output.dense, "parameter", inf_steps) if inf_steps else None
    recorder = StepRecorder(injector)
    settings = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        fp16=True,
        per_device_train_batch_size=8,
        max_steps=6,
        learning_rate=1e-3,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GradientScalingTrainer(
        model=model,
        args=TrainingArguments(**{**settings, **arguments}),
        train_dataset=TokenDataset(),
        callbacks=[recorder],
        make_gradient_scaler=make_scaler,
    )
    recorder.trainer = trainer
    return trainer, recorder


def logged(trainer: GradientScalingTrainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if "loss" in entry]


def test_trains_in_fp16_on_cpu_with_the_clip_norms_of_gradscaler(tmp_path: Path) -> None:
    trainer, recorder = make_trainer(tmp_path / "gs")
    dtypes = OutputDtypes(trainer.model.bert.encoder.layer[0].attention.self.query)
    trainer.train()
    reference, reference_recorder = make_trainer(tmp_path / "ref", reference_scaler)
    reference.train()
    assert dtypes.seen == {torch.float16}
    assert isinstance(trainer.gradient_scaler, GradientScaler) and trainer.gradient_scaler.iteration == 6
    assert recorder.skipped == reference_recorder.skipped == [False] * 6
    norms, reference_norms = logged(trainer, "grad_norm"), logged(reference, "grad_norm")
    assert max(norms) > 0.5  # the clipping bites
    assert norms[0] == reference_norms[0]
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(reference_norms), rtol=1e-3, atol=0)
    assert logged(trainer, "learning_rate") == logged(reference, "learning_rate")


@pytest.mark.parametrize("accumulation", [1, 2])
def test_injected_inf_skips_the_step_gradscaler_skips_and_holds_the_lr(tmp_path: Path, accumulation: int) -> None:
    runs = {}
    for kind, make_scaler in (("gs", GradientScaler), ("ref", reference_scaler)):
        trainer, recorder = make_trainer(
            tmp_path / kind,
            make_scaler,
            inf_steps=(2,),
            max_steps=4,
            gradient_accumulation_steps=accumulation,
            optim="adamw_torch",
        )
        trainer.train()
        runs[kind] = trainer, recorder
    (trainer, recorder), (reference, reference_recorder) = runs["gs"], runs["ref"]
    assert recorder.skipped == reference_recorder.skipped == [False, False, True, False]
    assert trainer.gradient_scaler.skipped_steps == 1 and trainer.gradient_scaler.iteration == 4 * accumulation
    rates = logged(trainer, "learning_rate")
    assert rates == logged(reference, "learning_rate")
    assert rates[3] == rates[2] < rates[1]  # the scheduler did not step on the skipped step
    norms, reference_norms = logged(trainer, "grad_norm"), logged(reference, "grad_norm")
    assert not math.isfinite(norms[2]) and not math.isfinite(reference_norms[2])  # the clip saw the inf
    finite = [0, 1, 3]
    torch.testing.assert_close(torch.tensor(norms)[finite], torch.tensor(reference_norms)[finite], rtol=1e-3, atol=0)


def test_with_fused_adamw_the_skip_holds_the_lr_where_gradscaler_steps_it(tmp_path: Path) -> None:
    """The Trainer's default optimizer is the fused AdamW, which takes GradScaler's found-inf flag into its
    own step: GradScaler then calls ``optimizer.step()`` on an overflowing step, so Accelerate records no
    skip and the LR scheduler steps; GradientScaler does not call it, and the LR is held."""
    runs = {}
    for kind, make_scaler in (("gs", GradientScaler), ("ref", reference_scaler)):
        trainer, recorder = make_trainer(tmp_path / kind, make_scaler, inf_steps=(2,), max_steps=4)
        weights = {}
        trainer.add_callback(_WeightsAtStepEnd(weights))
        trainer.train()
        runs[kind] = trainer, recorder, weights
    (trainer, recorder, weights), (reference, reference_recorder, reference_weights) = runs["gs"], runs["ref"]
    assert trainer.optimizer.optimizer.defaults["fused"]
    assert recorder.skipped == [False, False, True, False] and reference_recorder.skipped == [False] * 4
    # neither moved
    assert torch.equal(weights[2], weights[3]) and torch.equal(reference_weights[2], reference_weights[3])
    rates, reference_rates = logged(trainer, "learning_rate"), logged(reference, "learning_rate")
    assert rates[3] == rates[2] and reference_rates[3] < reference_rates[2]


class _WeightsAtStepEnd(TrainerCallback):
    """{global step after the step: a copy of the classifier's weight}."""

    def __init__(self, weights: dict[int, torch.Tensor]) -> None:
        self.weights = weights

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.weights[state.global_step] = model.classifier.weight.detach().clone()


def test_resume_from_checkpoint_is_bit_identical(tmp_path: Path) -> None:
    straight, _ = make_trainer(tmp_path / "straight", inf_steps=(4,), save_strategy="steps", save_steps=3)
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-3"
    assert (checkpoint / "scaler.pt").is_file()
    saved = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert saved["iteration"] == 3
    resumed, recorder = make_trainer(tmp_path / "resumed", inf_steps=(4,))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert recorder.skipped == [False, True, False]  # steps 4-6 of 6, the inf on step 4
    assert resumed.gradient_scaler.state_dict() == straight.gradient_scaler.state_dict()
    for (name, p), q in zip(resumed.model.named_parameters(), straight.model.parameters()):
        assert torch.equal(p, q), name


class _TwoTrials(HyperParamSearchBackendBase):
    """A search backend that runs two trials as the W&B sweep agent does (``trainer.train(trial=dict)`` inside a
    ``wandb.run``, whose id names the trial's folder), without a W&B server."""

    name = "wandb"  # an HPSearchBackend value whose trial is a plain dict of arguments
    trials = ({"learning_rate": 1e-3}, {"learning_rate": 3e-4})
    seen: list[tuple[Any, GradientScaler]] = []

    @staticmethod
    def is_available() -> bool:
        return True

    def default_hp_space(self, trial: Any) -> dict:
        return {}

    def run(self, trainer: GradientScalingTrainer, n_trials: int, direction: str, **kwargs: Any) -> None:
        for trial in self.trials[:n_trials]:
            trainer.train(trial=dict(trial))
            self.seen.append((trainer.model, trainer.gradient_scaler, trainer.args.learning_rate))


def test_hyperparameter_search_gives_each_trial_its_own_scaler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(transformers.trainer.ALL_HYPERPARAMETER_SEARCH_BACKENDS, HPSearchBackend.WANDB, _TwoTrials)
    monkeypatch.setattr(_TwoTrials, "seen", [])
    monkeypatch.setattr(wandb, "run", SimpleNamespace(id="offline"))
    made: list[tuple[Any, GradientScaler]] = []

    def make_scaler(model: Any) -> GradientScaler:
        made.append((model, GradientScaler(model)))
        return made[-1][1]

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        fp16=True,
        per_device_train_batch_size=8,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GradientScalingTrainer(
        args=args, model_init=tiny_bert, train_dataset=TokenDataset(), make_gradient_scaler=make_scaler
    )
    trainer.hyperparameter_search(backend="wandb", n_trials=2)
    (model_1, scaler_1, rate_1), (model_2, scaler_2, rate_2) = _TwoTrials.seen
    assert (rate_1, rate_2) == (1e-3, 3e-4)
    assert model_1 is not model_2 and scaler_1 is not scaler_2
    for model, scaler in ((model_1, scaler_1), (model_2, scaler_2)):
        assert (model, scaler) in made  # made for that trial's model
        assert scaler.iteration == 2 and scaler.skipped_steps == 0  # fresh, and it scaled that trial's backwards


def test_fp16_is_required(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"TrainingArguments\(fp16=True\)"):
        make_trainer(tmp_path, fp16=False)


def test_make_gradient_scaler_makes_the_scaler_in_use(tmp_path: Path) -> None:
    made: list[GradientScaler] = []

    def make_scaler(model: Any) -> GradientScaler:
        made.append(GradientScaler(model, underflow_rate=1e-4))
        return made[-1]

    trainer, _ = make_trainer(tmp_path, make_scaler)
    assert trainer.gradient_scaler is made[-1] is trainer.accelerator.scaler
    assert trainer.gradient_scaler.recipe.underflow_rate == 1e-4


def test_with_gradient_accumulation_no_step_is_skipped_where_gradscaler_skips_none(tmp_path: Path) -> None:
    """20 steps of 2 accumulated batches of 64 sequences, the Trainer's default learning rate and clipping: a
    branch's fp32 sum (the residual stream) took the largest incoming scale, 2^25, down the whole encoder, and
    the next batch's bias gradient overflowed (step 1 skipped at 2^32; GradScaler skipped none).
    ScalingRecipe.wide_branch_scale="smallest" takes the smallest incoming scale there."""

    class Sequences(TokenDataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.input_ids, self.labels = (
                torch.randint(1, 100, (64, SEQUENCE), generator=g),
                torch.randint(0, 2, (64,), generator=g),
            )

    skipped = {}
    for name, make_scaler in (("gs", GradientScaler), ("reference", reference_scaler)):
        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=100,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=32,
            num_labels=2,
        )
        model = BertForSequenceClassification(config)
        recorder = StepRecorder(None)
        args = TrainingArguments(
            output_dir=str(tmp_path / name),
            use_cpu=True,
            fp16=True,
            per_device_train_batch_size=8,
            max_steps=20,
            gradient_accumulation_steps=2,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            seed=0,
            disable_tqdm=True,
        )
        trainer = GradientScalingTrainer(
            model=model, args=args, train_dataset=Sequences(), callbacks=[recorder], make_gradient_scaler=make_scaler
        )
        recorder.trainer = trainer
        trainer.train()
        skipped[name] = recorder.skipped
    assert skipped["reference"] == [False] * 20
    assert skipped["gs"] == [False] * 20
