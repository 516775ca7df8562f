"""Both backends' own setup() and train_step() in one process, from the same weights on the same batches.

    python tests/e2e/parity_run.py IMAGEFOLDER_DIR OUT.npz [--lrs 0.02,0.04,...] [--mixes 0.7,none,...] [--flag value]

The ImageNet recipe's ResNet-18 (resnet18_v1b) is built by each backend; MXNet's copy then takes PyTorch's initial
weights (renamed by hvdtrain.weights). Real photos from the ImageFolder's train/ split, with the validation transform
(deterministic), are fed as the same batches to both. One learning rate and one mixup coefficient per step (changing
rates, as under warmup and cosine decay). Written to OUT.npz, in PyTorch's names, per framework F:
  F.loss        the logged loss of each step
  F.grad.NAME   the first step's gradient with weight decay, read from the first update (w0 - w1) / (lr (1 + m)),
                which Nesterov SGD with zero momentum makes on both frameworks
  F.final.NAME  every parameter and running statistic after the last step
  F.logits      inference-mode logits of the evaluation batch after the last step
``--no-momentum-correction 1`` leaves MXNet's momentum as its optimizer keeps it. Extra ``--flag value`` pairs override the recipe's settings of one framework, for showing what a fault moves:
``--mxnet.label_smoothing 0``; ``--all.FIELD value`` sets it on both (``--all.optimizer lamb``).
"""
import dataclasses
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from hvdtrain import weights  # noqa: E402
from hvdtrain.backends import make_backend  # noqa: E402
from hvdtrain.data import ArrayDataset  # noqa: E402
from hvdtrain.vision import ImageFolder, ImageTransform  # noqa: E402
from recipes.imagenet import ImageNetConfig, ImageNetTrainer  # noqa: E402

BATCH = 16
RECIPE = dict(model="resnet18_v1b", image_size=32, val_resize=32, num_classes=10, batch_size=BATCH, momentum=0.9,
              nesterov=True, weight_decay=1e-4, no_wd=True, label_smoothing=0.1, last_gamma=True, precision="fp32",
              epochs=1, warmup_epochs=0, num_workers=0, threads=1)


def photos(data_dir: str, n: int):
    folder = ImageFolder(os.path.join(data_dir, "train"), ImageTransform(train=False, size=32, resize=32))
    order = np.random.default_rng(0).permutation(len(folder))[:n]
    xs, ys = zip(*(folder[int(i)][:2] for i in order))
    return np.stack(xs).astype(np.float32), np.asarray(ys, np.int64)


def run(framework: str, cfg, x, y, x_eval, lrs, mixes, start):
    backend = make_backend(framework)
    backend.init(cfg)
    trainer = ImageNetTrainer(cfg)
    trainer.backend = backend
    backend.seed(cfg.seed)
    backend.setup(getattr(trainer, f"build_{framework}")(), cfg, sample_shape=x.shape[1:])
    if start is None:
        start = weights.rename(backend.model_arrays(), weights.TORCH)
    else:
        fitted, kept = weights.fit(backend.model_arrays(), start, "PyTorch's initial weights",
                                   to=backend.weight_naming)
        assert not kept
        backend.assign_model_arrays(fitted)
    out, losses = {}, []
    batches = backend.loader(ArrayDataset(x, y), range(len(x)), BATCH, drop_last=True)
    for step, (lr, mix) in enumerate(zip(lrs, mixes)):
        before = weights.rename(backend.model_arrays(), weights.TORCH) if step == 0 else None
        backend.set_lr(lr)
        losses.append(backend.scalar(backend.train_step([next(batches)], mix=mix)["loss"]))
        if step == 0:
            after = weights.rename(backend.model_arrays(), weights.TORCH)
            for name, w0 in before.items():
                if "running" not in name and weights.COUNTER not in name:
                    out[f"{framework}.grad.{name}"] = (w0 - after[name]) / (lr * (1 + cfg.momentum))
    for name, value in weights.rename(backend.model_arrays(), weights.TORCH).items():
        out[f"{framework}.final.{name}"] = value
    out[f"{framework}.loss"] = np.asarray(losses)
    out[f"{framework}.logits"] = backend.predict(backend.model, x_eval)
    return out, start


def _number_or_text(value: str):
    try:
        return float(value)
    except ValueError:
        return value


def main(argv):
    data_dir, path = argv[0], argv[1]
    lrs = [0.005, 0.01, 0.015, 0.02]
    mixes = [0.7, None, 0.4, None]
    per = {"torch": {}, "mxnet": {}}
    rest = argv[2:]
    for key, value in zip(rest[::2], rest[1::2]):
        if key == "--lrs":
            lrs = [float(v) for v in value.split(",")]
        elif key == "--no-momentum-correction":  # what MXNet's optimizer does by itself
            from hvdtrain.backends.mxnet import MXNetBackend
            MXNetBackend._correct_momentum = lambda self, ratio: None
        elif key == "--mixes":
            mixes = [None if v == "none" else float(v) for v in value.split(",")]
        else:
            fw, _, field = key[2:].partition(".")
            for name in (("torch", "mxnet") if fw == "all" else (fw,)):
                per[name][field] = (type(RECIPE.get(field, 0))(float(value)) if field in RECIPE or field == "seed"
                                    else _number_or_text(value))
    steps = len(lrs)
    x, y = photos(data_dir, BATCH * steps + 32)
    x_eval = x[BATCH * steps:]
    result, start = {}, None
    for framework in ("torch", "mxnet"):  # PyTorch first: its initial weights are the common start
        cfg = dataclasses.replace(ImageNetConfig(data_dir=data_dir, **RECIPE), framework=framework,
                                  **per[framework])
        out, start = run(framework, cfg, x[:BATCH * steps], y[:BATCH * steps], x_eval, lrs, mixes, start)
        result.update(out)
    np.savez(path, **result)


if __name__ == "__main__":
    main(sys.argv[1:])
