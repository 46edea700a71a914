"""The language models of the zoo: Hugging Face transformers from small configs, and PyTorch's
own sequence models.

Every transformer is built from a small config with random weights (no download): hidden size
32, 2 layers, 4 heads, a vocabulary of 128 tokens, sequences of 8 tokens, batch 2, and every
dropout probability of the config at 0. Each model is wrapped so that it returns one tensor of
logits laid out for the harness's cross-entropy, ``(N, C)`` or ``(N, C, T)``:

- the encoders (BERT, DistilBERT, RoBERTa, ``nn.TransformerEncoder``, LSTM, GRU) classify a
  sequence into one of 3 classes; the transformers take an attention mask whose last tokens of
  the second sequence are padding;
- the decoders (GPT-2, Llama, BLOOM, Mistral, and as slow cases Qwen2, Gemma, Phi, GPT-NeoX,
  OPT) return the logits of the next token at each position but the last, ``(N, V, T - 1)``;
  their labels are the input tokens shifted by one (causal LM loss); the further encoders
  (ALBERT, ELECTRA, DeBERTa-v2, MobileBERT) are slow sequence classifiers like BERT;
- T5 returns the decoder's logits ``(N, V, T)`` for a seq2seq task, reversing the input
  sequence: the decoder reads the reversed sequence shifted right by one start token.

The transformers train with AdamW, the recurrent models with SGD and momentum. Llama uses
grouped-query attention (2 key-value heads for 4 heads), which the TorchScript exporter cannot
convert; ``llama_mha`` (4 key-value heads) runs the same model through both exporters. RoBERTa
(BERT with other position ids), ``llama_mha`` and T5 (the largest) are ``slow``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zoo.harness import ADAMW, Batch, ZooCase
from zoo.torchvision_import import torchvision_models

VOCAB = 128
HIDDEN = 32
LAYERS = 2
HEADS = 4
SEQ = 8
BATCH = 2
CLASSES = 3
PADDING = 3
"""Padding tokens at the end of the second sequence of a masked batch."""


def _transformers() -> Any:
    """The ``transformers`` package (importing it imports torchvision, see torchvision_import)."""
    torchvision_models()
    import transformers

    return transformers


# ------------------------------------------------------------------- batches
def _tokens(g: torch.Generator) -> torch.Tensor:
    # tokens from 2 on: 0 starts T5's decoder, 1 is RoBERTa's padding token
    return torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)


def _ids(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (_tokens(g),)


def _ids_and_mask(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, SEQ - PADDING :] = 0
    return _tokens(g), mask


def _reversal(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    ids = _tokens(g)
    target = ids.flip(1)
    start = torch.zeros(BATCH, 1, dtype=torch.int64)
    return ids, torch.cat([start, target[:, :-1]], dim=1)


def _classes(inputs: tuple[torch.Tensor, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, CLASSES, (inputs[0].shape[0],), generator=g)


def _next_tokens(inputs: tuple[torch.Tensor, ...], g: torch.Generator) -> torch.Tensor:
    return inputs[0][:, 1:]


def _reversed(inputs: tuple[torch.Tensor, ...], g: torch.Generator) -> torch.Tensor:
    return inputs[0].flip(1)


# -------------------------------------------------------------------- models
class SequenceClassifier(nn.Module):
    """A Hugging Face ``...ForSequenceClassification`` model's logits ``(N, classes)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class CausalLM(nn.Module):
    """A Hugging Face ``...ForCausalLM`` model's next-token logits ``(N, V, T - 1)``: the
    logits at every position but the last, for the labels ``input_ids[:, 1:]``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits[:, :-1].transpose(1, 2)


class Seq2SeqLM(nn.Module):
    """A Hugging Face encoder-decoder's decoder logits ``(N, V, T)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids)
        return out.logits.transpose(1, 2)


class TransformerClassifier(nn.Module):
    """Token and position embeddings, ``nn.TransformerEncoder`` (batch first, pre-LayerNorm,
    GELU), mean pooling over the sequence and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Parameter(0.02 * torch.randn(SEQ, HIDDEN))
        layer = nn.TransformerEncoderLayer(
            HIDDEN,
            HEADS,
            2 * HIDDEN,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.encoder(self.tokens(input_ids) + self.positions)
        return self.head(x.mean(dim=1))


BAGS = 4
"""Bags in a batch of the ``nn.EmbeddingBag`` classifiers."""


def _bags(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A flat batch of tokens and the offsets of its :data:`BAGS` bags, the second one empty
    (as ``DataLoader``'s collate function of PyTorch's text classification tutorial makes)."""
    lengths = torch.randint(1, SEQ + 1, (BAGS,), generator=g)
    lengths[1] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    return torch.randint(2, VOCAB, (int(lengths.sum()),), generator=g), offsets


def _padded(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Tokens with :data:`PADDING` padding tokens (id 1) at the end of the second sequence
    and a sequence of padding only."""
    ids = _tokens(torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g))))
    ids = torch.cat([ids, torch.ones(1, SEQ, dtype=torch.int64)])
    ids[1, SEQ - PADDING :] = 1
    return (ids,)


def _reverse_bags(batch: Batch) -> Batch:
    """The bags of a flat batch, and their labels, in reverse order."""
    (text, offsets), labels = batch
    ends = [*offsets[1:].tolist(), text.shape[0]]
    bags = [text[start:end] for start, end in zip(offsets.tolist(), ends)][::-1]
    lengths = torch.tensor([len(bag) for bag in bags])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    return (torch.cat(bags), starts), labels.flip(0)


def _bag_classes(inputs: tuple[torch.Tensor, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, CLASSES, (inputs[1].shape[0],), generator=g)


class BagClassifier(nn.Module):
    """An ``nn.EmbeddingBag`` and a linear head: PyTorch's text classification tutorial's
    model with a flat input and offsets, or a bag per row of a 2-D input."""

    def __init__(self, **bag: Any) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(VOCAB, HIDDEN, **bag)
        self.fc = nn.Linear(HIDDEN, CLASSES)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc(self.embedding(ids, offsets))


class RecurrentClassifier(nn.Module):
    """Embeddings, a two-layer LSTM or a bidirectional GRU (batch first), and a linear head on
    the last time step's output."""

    def __init__(self, cell: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.rnn: nn.Module
        if cell == "lstm":
            self.rnn = nn.LSTM(HIDDEN, HIDDEN, num_layers=2, batch_first=True)
            width = HIDDEN
        else:
            self.rnn = nn.GRU(HIDDEN, HIDDEN, batch_first=True, bidirectional=True)
            width = 2 * HIDDEN
        self.head = nn.Linear(width, CLASSES)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(input_ids))
        return self.head(out[:, -1])


def _bert() -> nn.Module:
    tf = _transformers()
    config = tf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=2 * SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        num_labels=CLASSES,
    )
    return SequenceClassifier(tf.BertForSequenceClassification(config))


def _distilbert() -> nn.Module:
    tf = _transformers()
    config = tf.DistilBertConfig(
        vocab_size=VOCAB,
        dim=HIDDEN,
        n_layers=LAYERS,
        n_heads=HEADS,
        hidden_dim=2 * HIDDEN,
        max_position_embeddings=2 * SEQ,
        dropout=0.0,
        attention_dropout=0.0,
        seq_classif_dropout=0.0,
        num_labels=CLASSES,
    )
    return SequenceClassifier(tf.DistilBertForSequenceClassification(config))


def _roberta() -> nn.Module:
    tf = _transformers()
    config = tf.RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        max_position_embeddings=2 * SEQ + 2,  # positions start after the padding index (1)
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        num_labels=CLASSES,
        pad_token_id=1,
    )
    return SequenceClassifier(tf.RobertaForSequenceClassification(config))


def _gpt2() -> nn.Module:
    tf = _transformers()
    config = tf.GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=2 * SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return CausalLM(tf.GPT2LMHeadModel(config))


def _llama(kv_heads: int = HEADS // 2) -> nn.Module:
    """Llama; with fewer key-value heads than heads (the default) grouped-query attention."""
    tf = _transformers()
    config = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2 * SEQ,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return CausalLM(tf.LlamaForCausalLM(config))


def _t5() -> nn.Module:
    tf = _transformers()
    config = tf.T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=2 * HIDDEN,
        num_layers=LAYERS,
        num_heads=HEADS,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return Seq2SeqLM(tf.T5ForConditionalGeneration(config))


_ENCODER = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": 2 * HIDDEN,
    "max_position_embeddings": 2 * SEQ + 2,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
"""The BERT-like config fields every small encoder of the zoo shares."""
_DECODER = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": 2 * HIDDEN,
    "max_position_embeddings": 4 * SEQ,
}
"""The Llama-like config fields every small decoder of the zoo shares."""


def _classifier(model: str, config: str, **fields: Any) -> Callable[[], nn.Module]:
    """A Hugging Face sequence classifier ``model`` built from its ``config`` class."""

    def build() -> nn.Module:
        tf = _transformers()
        settings = getattr(tf, config)(vocab_size=VOCAB, num_labels=CLASSES, **fields)
        return SequenceClassifier(getattr(tf, model)(settings))

    return build


def _causal(model: str, config: str, **fields: Any) -> Callable[[], nn.Module]:
    """A Hugging Face causal LM ``model`` built from its ``config`` class."""

    def build() -> nn.Module:
        tf = _transformers()
        return CausalLM(getattr(tf, model)(getattr(tf, config)(vocab_size=VOCAB, **fields)))

    return build


def _case(
    name: str,
    build: Callable[[], nn.Module],
    inputs: Callable[[torch.Generator], tuple[torch.Tensor, ...]],
    labels: Callable[[tuple[torch.Tensor, ...], torch.Generator], torch.Tensor],
    input_names: tuple[str, ...],
    **options: Any,
) -> ZooCase:
    return ZooCase(name, build, inputs, labels, input_names=input_names, **options)


_MASKED = ("input_ids", "attention_mask")

def _causal_case(name: str, model: str, config: str, slow: bool = False, **fields: Any) -> ZooCase:
    return _case(name, _causal(model, config, **fields), _ids, _next_tokens, ("input_ids",),
                 optimizer=ADAMW, slow=slow)  # fmt: skip


def _classifier_case(
    name: str, model: str, config: str, slow: bool = False, **fields: Any
) -> ZooCase:
    return _case(name, _classifier(model, config, **fields), _ids_and_mask, _classes, _MASKED,
                 optimizer=ADAMW, slow=slow)  # fmt: skip

_SDPA_GQA = (
    "the TorchScript exporter has no conversion of scaled_dot_product_attention with"
    " enable_gqa=True (Llama's grouped-query attention): AssertionError in"
    " symbolic_opset14.scaled_dot_product_attention"
)
_T5_VIEW = (
    "the dynamo exporter's decompositions turn T5Attention's reshape of its transposed"
    " attention output into aten.view of a non-contiguous tensor with a dynamic batch:"
    " ValueError: Cannot view a tensor with shape [s, 8, 4, 8] and strides (256, 8, 64, 1)"
)

LANGUAGE_CASES: list[ZooCase] = [
    _case("bert", _bert, _ids_and_mask, _classes, _MASKED, optimizer=ADAMW),
    _case("distilbert", _distilbert, _ids_and_mask, _classes, _MASKED, optimizer=ADAMW),
    _case("roberta", _roberta, _ids_and_mask, _classes, _MASKED, optimizer=ADAMW, slow=True),
    _case("gpt2", _gpt2, _ids, _next_tokens, ("input_ids",), optimizer=ADAMW),
    _case(
        "llama",
        _llama,
        _ids,
        _next_tokens,
        ("input_ids",),
        optimizer=ADAMW,
        xfail={"torchscript": _SDPA_GQA},
    ),
    _case(
        "llama_mha",
        lambda: _llama(kv_heads=HEADS),
        _ids,
        _next_tokens,
        ("input_ids",),
        optimizer=ADAMW,
        slow=True,
    ),
    _case(
        "t5",
        _t5,
        _reversal,
        _reversed,
        ("input_ids", "decoder_input_ids"),
        optimizer=ADAMW,
        slow=True,
        xfail={"dynamo": _T5_VIEW},
    ),
    _case(
        "transformer_encoder",
        TransformerClassifier,
        _ids,
        _classes,
        ("input_ids",),
        optimizer=ADAMW,
    ),
    _case("embedding_bag", BagClassifier, _bags, _bag_classes, ("text", "offsets"),
          reverse=_reverse_bags),
    _case("embedding_bag_max_padding", lambda: BagClassifier(mode="max", padding_idx=1),
          _padded, _classes, ("input_ids",)),
    _case("lstm", lambda: RecurrentClassifier("lstm"), _ids, _classes, ("input_ids",)),
    _case("gru", lambda: RecurrentClassifier("gru"), _ids, _classes, ("input_ids",)),
    # more families: ALiBi (BLOOM), sliding-window and rotary attention (Mistral), then slow
    _causal_case("bloom", "BloomForCausalLM", "BloomConfig", hidden_size=HIDDEN, n_layer=LAYERS,
                 n_head=HEADS),
    _causal_case("mistral", "MistralForCausalLM", "MistralConfig", num_key_value_heads=HEADS,
                 **_DECODER),
    _causal_case("qwen2", "Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=HEADS,
                 **_DECODER, slow=True),
    _causal_case("gemma", "GemmaForCausalLM", "GemmaConfig", num_key_value_heads=HEADS,
                 head_dim=HIDDEN // HEADS, **_DECODER, slow=True),
    _causal_case("phi", "PhiForCausalLM", "PhiConfig", resid_pdrop=0.0, embd_pdrop=0.0,
                 attention_dropout=0.0, **_DECODER, slow=True),
    _causal_case("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", **_DECODER, slow=True),
    _causal_case("opt", "OPTForCausalLM", "OPTConfig", hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, ffn_dim=2 * HIDDEN, word_embed_proj_dim=HIDDEN,
                 max_position_embeddings=4 * SEQ, dropout=0.0, attention_dropout=0.0, slow=True),
    _classifier_case("albert", "AlbertForSequenceClassification", "AlbertConfig",
                     embedding_size=16, classifier_dropout_prob=0.0, **_ENCODER, slow=True),
    _classifier_case("electra", "ElectraForSequenceClassification", "ElectraConfig",
                     embedding_size=16, **_ENCODER, slow=True),
    _classifier_case("deberta_v2", "DebertaV2ForSequenceClassification", "DebertaV2Config",
                     pooler_dropout=0.0, **_ENCODER, slow=True),
    _classifier_case("mobilebert", "MobileBertForSequenceClassification", "MobileBertConfig",
                     embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
                     num_feedforward_networks=1, **_ENCODER, slow=True),
]
"""The language models of the zoo."""
