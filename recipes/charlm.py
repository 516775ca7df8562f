"""A character-level language model: a GRU predicting the next byte of English legal text.

Data: the licence texts every Debian system carries in /usr/share/common-licenses (package ``base-files``): the
Apache, Artistic, BSD, CC0, GFDL, GPL, LGPL and MPL texts, about 250 KB of English prose. ``--data-dir`` may name
any other directory of text files instead (every regular file in it, in name order). The bytes are cut into
sequences of ``--seq-len`` + 1; every tenth sequence is held out for validation. Metrics: perplexity per byte
(exp of the mean cross-entropy, from the summed token loss) and next-byte accuracy; records count tokens per second.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hvdtrain import ArrayDataset, ConfigError, TrainConfig, Trainer
from hvdtrain.config import BASE_LRS
from hvdtrain.metrics import Accuracy, Perplexity

CORPUS = "/usr/share/common-licenses"
LICENSES = ("Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1", "LGPL-3",
            "MPL-2.0")
"""The default corpus's files (others in that directory are links to these or older versions)."""
VOCAB = 256
"""Bytes: no vocabulary to build or ship."""


def read_corpus(directory: str) -> bytes:
    """The text files of ``directory`` as one byte string (the licence list for the default corpus)."""
    if not os.path.isdir(directory):
        hint = " (Debian's base-files package installs it)" if directory == CORPUS else ""
        raise ConfigError(f"--data-dir {directory} does not exist{hint}; give a directory of text files")
    names = LICENSES if directory == CORPUS else sorted(
        n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
    missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
    if missing:
        raise ConfigError(f"{directory} lacks {', '.join(missing)} (Debian's base-files package installs them)")
    text = b"\n".join(open(os.path.join(directory, n), "rb").read() for n in names)
    if not text:
        raise ConfigError(f"{directory} holds no text")
    return text


def sequences(text: bytes, seq_len: int):
    """(inputs, targets) of the training and validation parts: int64 arrays (n, seq_len), targets shifted by one."""
    data = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    n = (len(data) - 1) // seq_len
    if n < 20:
        raise ConfigError(f"the corpus has {len(data)} bytes: too few for sequences of --seq-len {seq_len}")
    x = data[:n * seq_len].reshape(n, seq_len)
    y = data[1:n * seq_len + 1].reshape(n, seq_len)
    val = np.arange(n) % 10 == 9
    return (x[~val], y[~val]), (x[val], y[val])


@dataclass
class CharLMConfig(TrainConfig):
    """Language-model defaults: Adam with gradient steps over 64-byte sequences."""

    epochs: int = 8
    batch_size: int = 32
    base_lrs = {**BASE_LRS, "adam": 0.004, "adamw": 0.004}
    optimizer: Literal["sgd", "adam", "adamw", "lars", "lamb"] = "adam"
    lr_mode: Literal["step", "cosine", "poly", "constant"] = "cosine"
    data_dir: str = CORPUS
    """Directory of text files (default: the licence texts of Debian's base-files)."""
    seq_len: int = 64
    """Bytes per training sequence (tokens per sample)."""
    embedding: int = 32
    """Size of each byte's embedding."""
    hidden: int = 128
    """Units of the GRU."""

    def validate(self) -> None:
        super().validate()
        if self.seq_len < 2:
            raise ConfigError(f"--seq-len must be at least 2, got {self.seq_len}")


class CharLMTrainer(Trainer):
    """Embedding, one GRU layer and a per-position classifier over bytes, on PyTorch or MXNet."""

    name = "charlm"
    config_class = CharLMConfig
    sample_unit = "sequences"

    @property
    def tokens_per_sample(self) -> int:
        return self.cfg.seq_len

    def check(self) -> None:
        super().check()
        read_corpus(self.cfg.data_dir)

    def datasets(self):
        train, val = sequences(read_corpus(self.cfg.data_dir), self.cfg.seq_len)
        return ArrayDataset(*train), ArrayDataset(*val)

    def metrics(self):
        return [Perplexity(), Accuracy()]

    def build_torch(self):
        from torch import nn
        cfg = self.cfg

        class CharGRU(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(VOCAB, cfg.embedding)
                self.rnn = nn.GRU(cfg.embedding, cfg.hidden, batch_first=True)
                self.out = nn.Linear(cfg.hidden, VOCAB)

            def forward(self, tokens):  # (N, T) -> (N, T, VOCAB)
                return self.out(self.rnn(self.embed(tokens))[0])
        return CharGRU()

    def build_mxnet(self):
        import mxnet as mx
        from mxnet.gluon import nn, rnn
        cfg = self.cfg
        # PyTorch's initialisation, so that both frameworks start alike: N(0, 1) embeddings, every GRU weight and
        # bias uniform(+-1/sqrt(hidden)), the classifier's bias uniform(+-1/sqrt(fan_in)) (its weight gets the same
        # from hvdtrain's default for uninitialised Gluon parameters).
        gru = mx.init.Uniform(1 / cfg.hidden ** 0.5)

        class CharGRU(nn.HybridBlock):
            def __init__(self):
                super().__init__()
                with self.name_scope():
                    self.embed = nn.Embedding(VOCAB, cfg.embedding, weight_initializer=mx.init.Normal(1.0))
                    self.rnn = rnn.GRU(cfg.hidden, layout="NTC", input_size=cfg.embedding,
                                       i2h_weight_initializer=gru, h2h_weight_initializer=gru,
                                       i2h_bias_initializer=gru, h2h_bias_initializer=gru)
                    self.out = nn.Dense(VOCAB, flatten=False, in_units=cfg.hidden,  # per position, as nn.Linear
                                        bias_initializer=mx.init.Uniform(1 / cfg.hidden ** 0.5))

            def hybrid_forward(self, F, tokens):
                return self.out(self.rnn(self.embed(tokens)))
        return CharGRU()

    @staticmethod
    def loss_torch():
        import torch.nn.functional as F

        def token_cross_entropy(logits, y):  # (N, T): one loss per position
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                   reduction="none").reshape(y.shape)
        return token_cross_entropy

    @staticmethod
    def loss_mxnet():
        import mxnet as mx

        def token_cross_entropy(logits, y):  # (N, T): one loss per position
            return -mx.nd.pick(mx.nd.log_softmax(logits.astype("float32"), axis=-1), y, axis=-1)
        return token_cross_entropy
