"""A third-party model zoo at small sizes, for the update-cost bench (issue 19), built from configs only.

Four families, each model a :class:`ZooModel` whose ``build(batch_scale, device)`` returns the network
in training mode on ``device`` and a closure that runs one forward on a fixed synthetic batch (the
sizes below times ``batch_scale`` samples, drawn on the CPU and moved, the same on every device) and
returns its loss:

* ``torchvision``  classifiers of ``torchvision.models.list_models()`` (a representative subset
  by default, every one with ``every_torchvision=True``), batch 2 at 32x32 (64x64 for all)
* ``timm``         a few timm architectures (only if ``timm`` is importable), batch 2 at 32x32

(``image_size`` sets both families' images instead: 224 for what ImageNet training computes.)
* ``transformers`` small Hugging Face configurations (only if ``transformers`` is importable):
  BERT (SDPA and eager attention), GPT-2, T5, ViT, Whisper; 2 layers of width 128 (or
  ``transformer_width``, heads of 64 features from 768 up), 64 tokens, random weights, no downloads
* ``rnn``          ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (128 units) on 8 packed sequences of up
  to 32 steps, with a linear head

Dropout draws from the global generator: seed it before each forward for repeatable losses.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence

Forward = Callable[[], Tensor]  # one forward on the model's fixed batch; returns its scalar loss

FAMILIES = ("torchvision", "timm", "transformers", "rnn")

# Default torchvision subset: one or two of each architecture family (residual, dense, depthwise,
# squeeze-excite, grouped, channel shuffle, fire modules, transformers with and without windows).
TORCHVISION_DEFAULT = (
    "resnet18",
    "resnet50",
    "densenet121",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "shufflenet_v2_x0_5",
    "squeezenet1_1",
    "regnet_y_400mf",
    "mnasnet0_5",
    "vgg11_bn",
    "convnext_tiny",
    "swin_t",
    "vit_b_32",
)
TIMM_DEFAULT = (
    "resnet18d",
    "vit_tiny_patch16_224",
    "convnext_atto",
    "efficientnet_b0",
    "mobilenetv3_small_100",
    "regnetx_002",
)
_NUM_CLASSES = 10
_BATCH = 2
# Transformers: 2 layers of width 128, sequences of 64 tokens (a plain backward of 5-15 ms here).
_VOCAB, _HIDDEN, _LENGTH = 512, 128, 64
# RNNs: 8 sequences of up to 32 steps, 32 input features, 128 hidden units.
_RNN_BATCH, _RNN_LENGTH, _RNN_INPUT, _RNN_HIDDEN = 8, 32, 32, 128


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: ``build(batch_scale, device)`` -> (network in training mode, its forward-and-loss
    closure)."""

    family: str
    name: str
    build: Callable[[int, torch.device | str], tuple[nn.Module, Forward]]


def _classifier(model: nn.Module, size: int, batch: int, device: torch.device | str) -> tuple[nn.Module, Forward]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size, size, generator=generator).to(device)
    labels = torch.randint(0, _NUM_CLASSES, (batch,), generator=generator).to(device)
    model.to(device).train()

    def forward() -> Tensor:
        out = model(images)
        logits = out.logits if hasattr(out, "logits") else out  # a transformers output
        return F.cross_entropy(logits, labels)

    return model, forward


# Classifiers that need a larger input than the zoo's: Inception's stem, MaxViT's 7x7 windows at stride 32.
_MIN_SIZE = {"inception_v3": 75, "maxvit_t": 224}


def _torchvision(name: str, size: int, scale: int, device: torch.device | str) -> tuple[nn.Module, Forward]:
    size = max(size, _MIN_SIZE.get(name, 0))
    kwargs: dict = {"num_classes": _NUM_CLASSES}
    if name.startswith("vit_"):
        patch = int(name.rsplit("_", 1)[1])
        size = kwargs["image_size"] = -(-size // patch) * patch  # a whole number of patches
    if name in ("inception_v3", "googlenet"):
        kwargs |= {"aux_logits": False, "init_weights": True}
    return _classifier(torchvision.models.get_model(name, weights=None, **kwargs), size, _BATCH * scale, device)


def _timm(name: str, size: int, scale: int, device: torch.device | str) -> tuple[nn.Module, Forward]:
    import timm

    kwargs = {"img_size": size} if "vit" in name else {}
    return _classifier(
        timm.create_model(name, pretrained=False, num_classes=_NUM_CLASSES, **kwargs), size, _BATCH * scale, device
    )


def _tokens(batch: int, length: int = _LENGTH) -> Tensor:
    return torch.randint(0, _VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


def _language_model(
    model: nn.Module, inputs: dict[str, Tensor], device: torch.device | str
) -> tuple[nn.Module, Forward]:
    model.to(device).train()
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    return model, lambda: model(**inputs).loss


def _heads(width: int) -> int:
    """Attention heads at ``width``: 4 at the zoo's 128, BERT-base's heads of 64 features at 768 and up."""
    return max(4, width // 64)


def _bert(attention: str, width: int, scale: int, device: torch.device | str) -> tuple[nn.Module, Forward]:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=_VOCAB,
        hidden_size=width,
        num_hidden_layers=2,
        num_attention_heads=_heads(width),
        intermediate_size=4 * width,
        max_position_embeddings=_LENGTH,
        num_labels=_NUM_CLASSES,
        attn_implementation=attention,
    )
    labels = torch.randint(0, _NUM_CLASSES, (_BATCH * scale,), generator=torch.Generator().manual_seed(1))
    return _language_model(
        BertForSequenceClassification(config), {"input_ids": _tokens(_BATCH * scale), "labels": labels}, device
    )


def _gpt2(width: int, scale: int, device: torch.device | str) -> tuple[nn.Module, Forward]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=_VOCAB, n_embd=width, n_layer=2, n_head=_heads(width), n_positions=_LENGTH)
    tokens = _tokens(_BATCH * scale)
    return _language_model(GPT2LMHeadModel(config), {"input_ids": tokens, "labels": tokens}, device)


def _t5(width: int, scale: int, device: torch.device | str) -> tuple[nn.Module, Forward]:
    from transformers import T5Config, T5ForConditionalGeneration

    heads = _heads(width)
    config = T5Config(
        vocab_size=_VOCAB,
        d_model=width,
        d_kv=width // heads,
        d_ff=4 * width,
        num_layers=2,
        num_heads=heads,
        decoder_start_token_id=0,
    )
    return _language_model(
        T5ForConditionalGeneration(config),
        {"input_ids": _tokens(_BATCH * scale), "labels": _tokens(_BATCH * scale, _LENGTH // 4)},
        device,
    )


def _hf_vit(width: int, scale: int, device: torch.device | str) -> tuple[nn.Module, Forward]:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=4,
        hidden_size=width,
        num_hidden_layers=2,
        num_attention_heads=_heads(width),
        intermediate_size=4 * width,
        num_labels=_NUM_CLASSES,
    )
    return _classifier(ViTForImageClassification(config), 32, _BATCH * scale, device)


def _whisper(width: int, scale: int, device: torch.device | str) -> tuple[nn.Module, Forward]:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=_VOCAB,
        d_model=width,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=_heads(width),
        decoder_attention_heads=_heads(width),
        encoder_ffn_dim=4 * width,
        decoder_ffn_dim=4 * width,
        num_mel_bins=16,
        max_source_positions=_LENGTH,
        max_target_positions=_LENGTH,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    # 2 × max_source_positions frames
    features = torch.randn(_BATCH * scale, 16, 2 * _LENGTH, generator=torch.Generator().manual_seed(0))
    labels = _tokens(_BATCH * scale, _LENGTH // 4)
    return _language_model(
        WhisperForConditionalGeneration(config), {"input_features": features, "labels": labels}, device
    )


class PackedRNNClassifier(nn.Module):
    """A recurrent layer over packed variable-length sequences, its final hidden state classified by a ``Linear``."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn
        directions = 2 if rnn.bidirectional else 1
        self.head = nn.Linear(directions * (rnn.proj_size or rnn.hidden_size), _NUM_CLASSES)

    def forward(self, sequences: Tensor, lengths: Tensor) -> Tensor:
        _, hidden = self.rnn(pack_padded_sequence(sequences, lengths, enforce_sorted=False))
        h = hidden[0] if isinstance(hidden, tuple) else hidden  # (layers · directions, batch, features)
        directions = 2 if self.rnn.bidirectional else 1
        return self.head(torch.cat(list(h[-directions:]), dim=-1))


def _rnn(rnn: nn.RNNBase, scale: int, device: torch.device | str) -> tuple[nn.Module, Forward]:
    generator = torch.Generator().manual_seed(0)
    batch = _RNN_BATCH * scale
    sequences = torch.randn(_RNN_LENGTH, batch, rnn.input_size, generator=generator).to(device)
    # variable lengths, the longest first (on the CPU, as packing wants)
    lengths = torch.linspace(_RNN_LENGTH, 3, batch).long()
    labels = torch.randint(0, _NUM_CLASSES, (batch,), generator=generator).to(device)
    model = PackedRNNClassifier(rnn).to(device).train()
    return model, lambda: F.cross_entropy(model(sequences, lengths), labels)


def _rnns() -> list[ZooModel]:
    return [
        ZooModel(
            "rnn",
            "lstm-2layer-bidirectional",
            lambda k, d: _rnn(nn.LSTM(_RNN_INPUT, _RNN_HIDDEN, num_layers=2, bidirectional=True), k, d),
        ),
        ZooModel(
            "rnn", "lstm-proj", lambda k, d: _rnn(nn.LSTM(_RNN_INPUT, _RNN_HIDDEN, proj_size=_RNN_HIDDEN // 2), k, d)
        ),
        ZooModel("rnn", "gru-2layer", lambda k, d: _rnn(nn.GRU(_RNN_INPUT, _RNN_HIDDEN, num_layers=2), k, d)),
        ZooModel(
            "rnn",
            "rnn-tanh-bidirectional",
            lambda k, d: _rnn(nn.RNN(_RNN_INPUT, _RNN_HIDDEN, bidirectional=True), k, d),
        ),
    ]


def zoo(
    families: tuple[str, ...] = FAMILIES,
    every_torchvision: bool = False,
    names: tuple[str, ...] = (),
    image_size: int | None = None,
    transformer_width: int = _HIDDEN,
) -> list[ZooModel]:
    """The zoo's models in ``families``; timm and transformers only where installed.

    Args:
        families: Which of :data:`FAMILIES`.
        every_torchvision: Every classifier of ``torchvision.models.list_models()`` at 64x64 instead
            of :data:`TORCHVISION_DEFAULT` at 32x32.
        names: If given, only the models with these names.
        image_size: Height and width of the torchvision and timm models' images, instead of 32
            (64 with ``every_torchvision``).
        transformer_width: Width of the transformers family's configurations (BERT-base's is 768).
    """
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown zoo families {sorted(unknown)}; expected some of {FAMILIES}")
    models: list[ZooModel] = []
    if "torchvision" in families:
        chosen, size = (
            (torchvision.models.list_models(module=torchvision.models), 64)
            if every_torchvision
            else (TORCHVISION_DEFAULT, 32)
        )
        models += [
            ZooModel("torchvision", n, lambda k, d, n=n, size=image_size or size: _torchvision(n, size, k, d))
            for n in chosen
        ]
    if "timm" in families and importlib.util.find_spec("timm") is not None:
        models += [ZooModel("timm", n, lambda k, d, n=n: _timm(n, image_size or 32, k, d)) for n in TIMM_DEFAULT]
    if "transformers" in families and importlib.util.find_spec("transformers") is not None:
        width = transformer_width
        models += [
            ZooModel("transformers", "bert-sdpa", lambda k, d: _bert("sdpa", width, k, d)),
            ZooModel("transformers", "bert-eager", lambda k, d: _bert("eager", width, k, d)),
            ZooModel("transformers", "gpt2", lambda k, d: _gpt2(width, k, d)),
            ZooModel("transformers", "t5", lambda k, d: _t5(width, k, d)),
            ZooModel("transformers", "vit", lambda k, d: _hf_vit(width, k, d)),
            ZooModel("transformers", "whisper", lambda k, d: _whisper(width, k, d)),
        ]
    if "rnn" in families:
        models += _rnns()
    if names:
        models = [m for m in models if m.name in names]
    return models
