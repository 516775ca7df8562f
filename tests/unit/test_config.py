import dataclasses
from dataclasses import dataclass

import pytest

from hvdtrain.config import (GROUPS_AUTO, GROUPS_BUCKETS, ConfigError, TrainConfig, field_docs, help_text,
                             parse_overrides)


def test_every_field_is_documented():
    docs = field_docs(TrainConfig)
    missing = [f.name for f in dataclasses.fields(TrainConfig) if not docs.get(f.name)]
    assert not missing, f"fields without a docstring: {missing}"


def test_types_are_converted():
    cfg = parse_overrides(TrainConfig, ["--epochs", "3", "--base-lr=0.5", "--framework", "mxnet",
                                        "--lr-milestones", "30,60,80", "--fp16-allreduce", "--no-nesterov"])
    assert cfg.epochs == 3 and cfg.base_lr == 0.5 and cfg.framework == "mxnet"
    assert cfg.lr_milestones == (30, 60, 80)
    assert cfg.fp16_allreduce is True and cfg.nesterov is False


def test_allreduce_groups_takes_its_names_on_the_command_line_and_in_a_file(tmp_path):
    assert parse_overrides(TrainConfig, ["--allreduce-groups", "buckets"]).allreduce_groups == GROUPS_BUCKETS
    assert parse_overrides(TrainConfig, ["--allreduce-groups=auto"]).allreduce_groups == GROUPS_AUTO
    assert parse_overrides(TrainConfig, ["--allreduce-groups", "3"]).allreduce_groups == 3
    path = tmp_path / "cfg.yaml"
    path.write_text("allreduce-groups: buckets\n")
    cfg = parse_overrides(TrainConfig, ["--config", str(path)])
    assert cfg.allreduce_groups == GROUPS_BUCKETS and cfg.grouped_explicitly
    cfg.validate()
    assert not TrainConfig().grouped_explicitly and not TrainConfig(allreduce_groups=0).grouped_explicitly


def test_bool_accepts_explicit_values():
    assert parse_overrides(TrainConfig, ["--synthetic=false"]).synthetic is False
    assert parse_overrides(TrainConfig, ["--synthetic=yes"]).synthetic is True


@pytest.mark.parametrize("argv, fragment", [
    (["--epochs", "three"], "--epochs expects an integer, got 'three'"),
    (["--framework", "jax"], "--framework expects one of torch, mxnet, got 'jax'"),
    (["--batchsize", "3"], "unknown option --batchsize"),
    (["--epochs"], "--epochs expects an integer after it"),
    (["epochs", "3"], "unexpected argument 'epochs'"),
    (["--allreduce-groups", "bucket"], "--allreduce-groups expects an integer or auto or buckets, got 'bucket'"),
])
def test_bad_flags_name_the_flag(argv, fragment):
    with pytest.raises(ConfigError) as e:
        parse_overrides(TrainConfig, argv)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, fragment", [
    ({"batch_size": 0}, "--batch-size must be at least 1, got 0"),
    ({"epochs": 0}, "--epochs must be at least 1"),
    ({"accumulate": 0}, "--accumulate must be at least 1"),
    ({"base_lr": -1.0}, "--base-lr must be positive"),
    ({"warmup_epochs": 9.0, "epochs": 5}, "--warmup-epochs must be between 0 and --epochs"),
    ({"lr_milestones": (60, 30)}, "--lr-milestones must be increasing"),
    ({"resume": "/nonexistent/ckpt.npz"}, "--resume must be auto, never or an existing checkpoint file"),
    ({"adasum": True, "precision": "fp16"}, "--adasum cannot be combined with loss scaling"),
    ({"adasum": True, "loss_scale": "dynamic"}, "--adasum cannot be combined with loss scaling"),
    ({"allreduce_groups": -3}, "--allreduce-groups must be auto (-1), buckets (-2), 0 or a number of groups, got -3"),
    ({"allreduce_groups": -2, "framework": "mxnet"}, "--allreduce-groups buckets is PyTorch's"),
    ({"allreduce_groups": -2, "elastic": True}, "--allreduce-groups cannot be combined with --elastic"),
    ({"allreduce_groups": -2, "adasum": True}, "--allreduce-groups cannot be combined with --adasum"),
    ({"allreduce_groups": 1, "elastic": True}, "--allreduce-groups cannot be combined with --elastic"),
    ({"optimizer": "lars", "adasum": True}, "--optimizer lars cannot be combined with --adasum: its trust ratio"),
    ({"optimizer": "lamb", "shard_optimizer": True}, "--optimizer lamb cannot be combined with --shard-optimizer"),
    ({"optimizer": "lars", "nesterov": True}, "--nesterov is for --optimizer sgd"),
    ({"trust_coefficient": 0.0}, "--trust-coefficient must be positive"),
    ({"lr_end": 1e-4}, "--lr-end is the rate --lr-mode cosine or poly decays to"),
    ({"optimizer_eps": -1.0}, "--optimizer-eps must be 0 or more"),
    ({"track_uri": "sqlite:///x.db"}, "--track-uri and --track-experiment need --track mlflow"),
])
def test_validate_names_the_flag(kw, fragment):
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(TrainConfig(), **kw).validate()
    assert fragment in str(e.value)


def test_subclass_fields_and_docs_are_inherited():
    @dataclass
    class MyConfig(TrainConfig):
        width: int = 4
        """Channels of the first layer."""

    cfg = parse_overrides(MyConfig, ["--width", "8", "--epochs", "2"])
    assert (cfg.width, cfg.epochs) == (8, 2)
    text = help_text(MyConfig, "mine")
    assert "--width WIDTH" in text and "Channels of the first layer." in text and "--epochs EPOCHS" in text


def test_yaml_config_file_then_flags(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("epochs: 7\nbase-lr: 0.2\nlr_milestones: [3, 5]\nnesterov: true\nframework: mxnet\n")
    cfg = parse_overrides(TrainConfig, ["--epochs", "2", "--config", str(path)])
    assert (cfg.epochs, cfg.base_lr, cfg.lr_milestones, cfg.nesterov, cfg.framework) == (2, 0.2, (3, 5), True, "mxnet")


def test_yaml_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    target = tmp_path / "pwned"
    path = tmp_path / "evil.yaml"
    path.write_text(f"epochs: !!python/object/apply:os.system ['touch {target}']\n")
    with pytest.raises(ConfigError) as e:
        parse_overrides(TrainConfig, ["--config", str(path)])
    assert "is not plain YAML" in str(e.value) and "\n" not in str(e.value)
    assert not target.exists()


@pytest.mark.parametrize("text, fragment", [("epochs: [1, 2]\n", "--epochs expects an integer"),
                                            ("bogus: 1\n", "unknown option 'bogus'"),
                                            ("- 1\n- 2\n", "must hold a mapping")])
def test_bad_config_files_name_the_problem(tmp_path, text, fragment):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        parse_overrides(TrainConfig, ["--config", str(path)])


def test_loss_scale_auto_follows_the_precision():
    assert TrainConfig(precision="fp16").dynamic_loss_scale()
    assert not TrainConfig(precision="bf16").dynamic_loss_scale()
    assert TrainConfig(precision="fp32", loss_scale="dynamic").dynamic_loss_scale()
    assert not TrainConfig(precision="fp16", loss_scale="none").dynamic_loss_scale()
    assert not TrainConfig().dynamic_loss_scale("bf16") and TrainConfig().dynamic_loss_scale("fp16")  # auto resolved
    assert TrainConfig().precision == "auto"


def test_imagenet_rate_per_256_images_and_crop_area():
    from recipes.imagenet import ImageNetConfig
    assert parse_overrides(ImageNetConfig, ["--batch-size", "64", "--lr-per-256", "0.2"]).base_lr == pytest.approx(0.05)
    assert parse_overrides(ImageNetConfig, ["--base-lr", "0.3"]).base_lr == 0.3, "an explicit rate wins"
    with pytest.raises(ConfigError, match="--min-crop-area must be in"):
        parse_overrides(ImageNetConfig, ["--min-crop-area", "0"]).validate()


@pytest.mark.parametrize("spec", ["val_loss:min:max", "val_loss:up", ":min", "val_loss:"])
def test_a_monitor_spec_other_than_key_and_direction_is_refused(spec):
    """Issue 47, item 7: val_loss:min:max was accepted (as max)."""
    with pytest.raises(ConfigError) as e:
        parse_overrides(TrainConfig, ["--monitor", spec]).validate()
    assert f"--monitor {spec!r}: give a record key, optionally followed by :min or :max" in str(e.value)
    parse_overrides(TrainConfig, ["--monitor", "val_loss:min"]).validate()


def test_each_optimizer_has_its_usual_epsilon_and_exemptions():
    eps = {name: TrainConfig(optimizer=name).eps() for name in ("adam", "adamw", "lamb", "lars")}
    assert eps == {"adam": 1e-8, "adamw": 1e-8, "lamb": 1e-6, "lars": 0.0}
    assert TrainConfig(optimizer="lamb", optimizer_eps=1e-9).eps() == 1e-9
    # biases and normalization weights: exempt under lars and lamb always, otherwise with --no-wd
    assert TrainConfig(optimizer="lars").exempt(1) and TrainConfig(optimizer="lamb").exempt(1)
    assert not TrainConfig(optimizer="adamw").exempt(1) and TrainConfig(optimizer="adamw", no_wd=True).exempt(1)
    assert not TrainConfig(optimizer="lars").exempt(2)


def test_every_recipe_offers_every_optimizer():
    """A recipe that narrows a field's choices must not drop the framework's optimizers (charlm and regression
    once offered sgd and adam only, so --optimizer adamw or lamb was refused there)."""
    import typing
    from hvdtrain import registry
    every = typing.get_args(typing.get_type_hints(TrainConfig)["optimizer"])
    for name in registry.available():
        cls = registry.load(name).config_class
        assert typing.get_args(typing.get_type_hints(cls)["optimizer"]) == every, name
        assert parse_overrides(cls, ["--optimizer", "lamb"]).optimizer == "lamb"
