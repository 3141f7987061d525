"""TPUEstimator: the estimator as a device, fit/evaluate/predict against CPU references,
checkpoints that resume exactly, and clear errors."""

from __future__ import annotations

import copy
import json
import os
import re
import signal

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torch_tpu
from torch_tpu.estimator import BatchError, Callback, EarlyStopping, History, LossConfigError, TPUEstimator, batch_loss

RTOL, ATOL = 1e-4, 1e-5


def classification_data(n: int = 100, d: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


def regression_data(n: int = 100, d: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, d, generator=g)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True) * 0.5)


def mlp(out: int = 2, d: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, out))


def cpu_reference(model, loader, loss, epochs=1, lr=1e-3, accum=1):
    """The plain loop the estimator must equal: unpadded batches, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        batches = list(loader)
        for i in range(0, len(batches), accum):
            group = batches[i : i + accum]
            n = sum(len(y) for _, y in group)
            total = 0.0
            for x, y in group:
                part = loss(model(x), y, reduction="sum") / n
                part.backward()
                total += part.item()
            opt.step()
            opt.zero_grad()
            losses.append(total)
    return losses


def assert_weights_equal(tpu_model, cpu_model, rtol=RTOL, atol=ATOL):
    for (name, a), b in zip(cpu_model.state_dict().items(), tpu_model.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a.cpu(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------- the estimator as a device
def test_seed_snippet_runs_as_written():
    class YourModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

        def forward(self, x):
            return self.net(x)

    your_dataset = classification_data()
    tpu = torch_tpu.TPUEstimator()
    model = YourModel().to(tpu)
    train_loader = DataLoader(your_dataset, batch_size=64)
    history = tpu.fit(model, train_loader)
    assert isinstance(history, History) and len(history.loss) == 2
    assert next(model.parameters()).device.type == "tpu"


def test_estimator_is_the_device():
    est = TPUEstimator(verbose=False)
    assert torch.device(est) == torch.device("tpu:0") == est.device
    assert torch.ones(2).to(est).device.type == "tpu"
    assert torch.zeros(2, device=est).device.type == "tpu"
    assert torch.ones(2).to(est, torch.float64).dtype == torch.float64
    assert nn.Linear(2, 2).to(device=est).weight.device.type == "tpu"
    assert len(est.devices) >= 1
    assert f"platform='{torch_tpu.platform()}'" in repr(est)
    with pytest.raises(ValueError):
        TPUEstimator(mode="fast")


# ---------------------------------------------------------------------- fit against CPU
def test_padded_last_batch_matches_unpadded_cpu_and_never_recompiles():
    data = classification_data(100)
    cpu = mlp()
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(data, batch_size=32)  # 32, 32, 32 and a last batch of 4
    want = cpu_reference(cpu, loader, nn.functional.cross_entropy, epochs=3)
    seen = []

    def misses(est, logs):
        seen.append(torch_tpu.cache_stats()["misses"])

    history = TPUEstimator(verbose=False).fit(tpu.to("tpu"), loader, epochs=3, callbacks=[misses])
    torch.testing.assert_close(torch.tensor(history.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_weights_equal(tpu, cpu)
    # Two warm-up steps (the optimizer state appears at step 1); then one program for every
    # step, the padded last batch included.
    assert seen[2] == seen[-1], seen
    assert history.programs_compiled >= 1 and history.compile_seconds > 0
    assert len(history.epochs) == 3 and history.epochs[0]["samples"] == 100


def test_float_targets_use_mse_and_grad_accumulation_clipping_scheduler():
    data = regression_data(96)
    cpu = mlp(out=1)
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(data, batch_size=16)
    want = cpu_reference(cpu, loader, nn.functional.mse_loss, accum=2)
    est = TPUEstimator(verbose=False)
    history = est.fit(tpu, loader, grad_accum_steps=2)
    torch.testing.assert_close(torch.tensor(history.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_weights_equal(tpu, cpu)

    # An optimizer factory, a scheduler factory and clipping, against the same CPU loop.
    cpu, tpu = mlp(out=1), mlp(out=1)
    opt = torch.optim.SGD(cpu.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for x, y in loader:
        nn.functional.mse_loss(cpu(x), y).backward()
        nn.utils.clip_grad_norm_(cpu.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        sched.step()
    h = est.fit(
        tpu.to(est), loader, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), clip_grad_norm=0.05,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    )
    assert_weights_equal(tpu, cpu)
    assert [s["lr"] for s in h.steps][:4] == [0.1, 0.1, 0.05, 0.05]


def test_batch_forms_dict_hf_loss_single_tensor_and_custom_loss():
    class HFStyle(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 2)

        def forward(self, input_ids, labels):
            logits = self.lin(input_ids)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    x, y = classification_data(64).tensors
    dicts = [{"input_ids": x[i : i + 16], "labels": y[i : i + 16]} for i in range(0, 64, 16)]
    est = TPUEstimator(verbose=False)
    torch.manual_seed(0)
    hf = HFStyle()
    ref = copy.deepcopy(hf)
    hf.to(est)
    h = est.fit(hf, dicts, optimizer=torch.optim.SGD(hf.parameters(), lr=0.5))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for d in dicts:
        ref(**d)["loss"].backward()
        opt.step()
        opt.zero_grad()
    assert_weights_equal(hf, ref)
    assert len(h.loss) == 4

    # A single tensor batch needs a loss: here an autoencoder's reconstruction error.
    torch.manual_seed(0)
    ae = nn.Linear(8, 8)
    h = est.fit(ae, DataLoader(x, batch_size=16), loss_fn=batch_loss(lambda out, batch: ((out - batch) ** 2).mean()),
                epochs=3)
    assert h.loss[-1] < h.loss[0]
    with pytest.raises(TypeError, match="loss_fn"):
        est.fit(nn.Linear(8, 8), DataLoader(x, batch_size=16))


# ---------------------------------------------------------------------- evaluate and predict
def test_evaluate_and_predict_match_cpu():
    data = classification_data(100)
    cpu = mlp()
    tpu = copy.deepcopy(cpu).to("tpu")
    loader = DataLoader(data, batch_size=32)
    x, y = data.tensors
    est = TPUEstimator(verbose=False)

    def top1_error(pred, target):
        return (pred.argmax(1) != target).float().mean()

    got = est.evaluate(tpu, loader, metrics=["accuracy", top1_error])
    with torch.no_grad():
        logits = cpu(x)
    assert got["loss"] == pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=1e-4)
    acc = (logits.argmax(1) == y).float().mean().item()
    assert got["accuracy"] == pytest.approx(acc, abs=1e-6)
    assert got["top1_error"] == pytest.approx(1 - acc, abs=1e-5)
    out = est.predict(tpu, loader)
    assert out.device.type == "cpu" and out.shape == (100, 2)
    torch.testing.assert_close(out, logits, rtol=RTOL, atol=ATOL)
    assert est.last_predict_stats["batches"] == 4 and est.last_predict_stats["samples_per_s"] > 0
    reg = regression_data(40)
    m = mlp(out=1)
    with torch.no_grad():
        want = nn.functional.mse_loss(m(reg.tensors[0]), reg.tensors[1]).item()
    got = est.evaluate(copy.deepcopy(m), DataLoader(reg, batch_size=16), metrics=["mse"])
    assert got["mse"] == pytest.approx(want, rel=1e-4) and got["loss"] == pytest.approx(want, rel=1e-4)


# ---------------------------------------------------------------------- history, callbacks
def test_history_plot_to_dict_callbacks_and_early_stopping(tmp_path):
    data = classification_data(64)
    loader = DataLoader(data, batch_size=16)
    events = []

    class Recorder(Callback):
        def on_epoch_end(self, est, logs):
            events.append(("epoch", logs["epoch"]))

        def on_validation_end(self, est, logs):
            events.append(("val", round(logs["accuracy"], 3)))

    est = TPUEstimator(verbose=False)
    # lr 0 cannot improve the validation loss, so early stopping ends the run after patience epochs.
    h = est.fit(mlp(), loader, epochs=10, val_loader=loader, metrics=["accuracy"],
                optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                callbacks=[Recorder(), EarlyStopping("val_loss", patience=2)])
    assert len(h.epochs) == 3 and h.stopped_early
    assert [e[0] for e in events] == ["val", "epoch"] * 3
    d = json.loads(json.dumps(h.to_dict()))
    assert len(d["steps"]) == 12 and "val_accuracy" in d["epochs"][0]
    path = h.plot(str(tmp_path / "curves.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- checkpoints
class _StopAt(Callback):
    """Ctrl-C at a step: the estimator notes the signal, finishes the step, saves and re-raises."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, est, logs):
        if logs["step"] == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    data = classification_data(80)

    def run(ckdir, stop=None):
        torch.manual_seed(3)  # the shuffle order
        loader = DataLoader(data, batch_size=16, shuffle=True)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 2))
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.normal_(p, std=0.3)
        est = TPUEstimator(verbose=False)
        sched = lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9)  # noqa: E731
        kw = dict(epochs=3, checkpoint_dir=ckdir, scheduler=sched, callbacks=[_StopAt(stop)] if stop else [])
        try:
            return est.fit(model, loader, **kw), model
        except KeyboardInterrupt:
            return None, model

    full, m_full = run(str(tmp_path / "a"))
    assert run(str(tmp_path / "b"), stop=7)[0] is None  # mid-epoch 2 (5 batches an epoch)
    names = sorted(os.listdir(tmp_path / "b"))
    assert "latest" in names and not any(n.startswith(".tmp") for n in names)
    resumed, m_res = run(str(tmp_path / "b"))
    torch.testing.assert_close(torch.tensor(resumed.loss), torch.tensor(full.loss), rtol=1e-6, atol=1e-7)
    assert_weights_equal(m_res, m_full, rtol=1e-6, atol=1e-7)
    # A save interrupted midway leaves the previous checkpoint as the one loaded.
    from torch_tpu.estimator import checkpoint

    before = checkpoint.latest(str(tmp_path / "b"))
    os.makedirs(tmp_path / "b" / ".tmp-step-00000099-x")
    assert checkpoint.latest(str(tmp_path / "b")) == before


# ---------------------------------------------------------------------- errors
def test_clear_errors(tmp_path, capsys):
    est = TPUEstimator(verbose=True, checkpoint_every=1)  # verbose, but stderr is no terminal: quiet
    x, y = classification_data(48).tensors
    bad = [(x[:16], y[:16]), (x[16:32], y[16:32]), (torch.randn(16, 5), y[:16])]
    with pytest.raises(BatchError, match=r"batch 2 with shapes \(\(16, 5\), \(16,\)\)"):
        est.fit(mlp(), bad)
    with pytest.raises(ValueError, match="empty"):
        est.fit(mlp(), DataLoader(TensorDataset(x[:0], y[:0]), batch_size=4))
    with pytest.raises(ValueError, match="empty"):
        est.fit(mlp(), iter([]))
    xs = x.clone()
    xs[20] = float("nan")
    with pytest.raises(FloatingPointError, match="step 2"):
        est.fit(mlp(), DataLoader(TensorDataset(xs, y), batch_size=16), checkpoint_dir=str(tmp_path))
    from torch_tpu.estimator import checkpoint

    assert checkpoint.latest(str(tmp_path)).endswith("step-00000001")  # the last good one
    assert capsys.readouterr().err == ""


def test_step_losses_are_read_a_few_steps_at_a_time_and_a_nan_still_names_its_step(monkeypatch):
    """The loop reads its losses as one transfer per few steps, not one per step, and each step's
    loss is still CPU's; a NaN loss raises naming its own step, however late it was read."""
    from torch_tpu.estimator import loop
    from torch_tpu.tensor import storage

    reads = []
    many = storage.to_numpy_many
    monkeypatch.setattr(storage, "to_numpy_many", lambda ts: reads.append(len(ts)) or many(ts))
    data = classification_data(40 * 4)
    loader = DataLoader(data, batch_size=4)
    want = cpu_reference(mlp(), loader, nn.functional.cross_entropy)
    est = TPUEstimator(verbose=False)
    h = est.fit(mlp(), loader, log_every=1000)
    torch.testing.assert_close(torch.tensor(h.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert sum(reads) == 40 and len(reads) < 40 // (loop.STEPS_IN_FLIGHT - loop.STEPS_QUEUED) + 2, reads
    assert max(reads) == loop.STEPS_IN_FLIGHT + 1 - loop.STEPS_QUEUED, reads

    x, y = data.tensors
    x = x.clone()
    x[2 * 4 + 1] = float("nan")  # a row of the third batch: step 3's loss
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 3 \(epoch 0, batch 2\)"):
        TPUEstimator(verbose=False).fit(mlp(), DataLoader(TensorDataset(x, y), batch_size=4), log_every=1000)


# ---------------------------------------------------------------------- modes and precision
def test_compile_mode_matches_cpu_and_a_scheduler_does_not_recompile():
    torch._dynamo.reset()
    data = regression_data(64)
    cpu = mlp(out=1)
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(data, batch_size=16)
    opt = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.8)
    want = []
    for _ in range(2):
        for x, y in loader:
            loss = nn.functional.mse_loss(cpu(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            want.append(loss.item())
    compiles = []
    h = TPUEstimator(mode="compile", verbose=False).fit(
        tpu, loader, epochs=2, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        scheduler=lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.8),
        callbacks=[lambda est, logs: compiles.append(torch_tpu.metrics()["compile_count"])],
    )
    torch.testing.assert_close(torch.tensor(h.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_weights_equal(tpu, cpu)
    assert compiles[2] == compiles[-1], compiles  # a changing learning rate compiles nothing new
    torch._dynamo.reset()


def test_bf16_loss_within_2_percent_of_fp32():
    data = classification_data(256, d=16)
    loader = DataLoader(data, batch_size=32)
    final = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 2))
        h = TPUEstimator(precision=precision, verbose=False).fit(model, loader, epochs=7, max_steps=50)
        assert len(h.loss) == 50
        final[precision] = sum(h.loss[-8:]) / 8
        assert next(model.parameters()).dtype == torch.float32  # fp32 master weights
    assert abs(final["bf16"] - final["fp32"]) / final["fp32"] < 0.02, final


# ---------------------------------------------------------------------- data parallel
_DP_SCRIPT = r"""
import copy, sys, torch, torch_tpu
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch_tpu.estimator import TPUEstimator
from torch_tpu.distributed import sharding_of
g = torch.Generator().manual_seed(1)
x = torch.randn(100, 8, generator=g); y = (x[:, 0] > 0).long()
torch.manual_seed(0)
width = int(sys.argv[4])
m1 = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 2)); mn = copy.deepcopy(m1)
loader = DataLoader(TensorDataset(x, y), batch_size=32)
est = TPUEstimator(verbose=False, sharding=sys.argv[2], mode=sys.argv[3])
assert len(est.devices) == int(sys.argv[1]), est.devices
opts = []
hn = est.fit(mn, loader, epochs=2, optimizer=lambda p: opts.append(torch.optim.AdamW(p, lr=1e-3)) or opts[-1])
h1 = TPUEstimator(devices=1, verbose=False, mode=sys.argv[3]).fit(m1, loader, epochs=2)
w = mn[0].weight
assert len(sharding_of(w).device_set) == len(est.devices)
want_spec = ("data",) if sys.argv[2] == "fsdp" else ()
spec = lambda t: tuple(sharding_of(t).spec) + (None,) * (t.dim() - len(sharding_of(t).spec))
assert spec(w) == want_spec + (None,) * (w.dim() - len(want_spec)), sharding_of(w)
assert spec(opts[0].state[w]["exp_avg"]) == spec(w)
torch.testing.assert_close(torch.tensor(hn.loss), torch.tensor(h1.loss), rtol=1e-4, atol=0)
for a, b in zip(m1.parameters(), mn.parameters()):
    torch.testing.assert_close(b.cpu(), a.cpu(), rtol=1e-4, atol=1e-6)
out = est.predict(mn, loader)
torch.testing.assert_close(out, TPUEstimator(devices=1, verbose=False).predict(mn, loader), rtol=1e-4, atol=1e-6)
print("ok")
"""


# (8, "fsdp", "auto", 256): the last layer's [2, 256] weight does not split over 8 devices and stays
# replicated, but XLA split its AdamW moments along dim 1 in the step's outputs; the replayed step
# keeps each state in the layout it was captured with (it failed at the second batch before).
@pytest.mark.parametrize("n,sharding,mode,width", [(4, "dp", "auto", 16), (8, "dp", "auto", 16),
                                                  (4, "fsdp", "auto", 16), (8, "fsdp", "auto", 256),
                                                  (4, "dp", "compile", 16)])
def test_data_parallel_equals_one_device(n, sharding, mode, width):
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", _DP_SCRIPT, str(n), sharding, mode, str(width)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


# ---------------------------------------------------------------------- variable-length sequences
def test_variable_length_sequences_are_bucketed():
    class PerToken(nn.Module):  # a position-wise language model: right padding cannot leak
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(20, 16), nn.Linear(16, 20)

        def forward(self, idx):
            return self.out(torch.tanh(self.emb(idx)))

    g = torch.Generator().manual_seed(4)
    lengths = [5, 7, 12, 16, 6, 9, 13, 8, 11, 15]
    batches = [(torch.randint(1, 20, (4, n), generator=g), torch.randint(0, 20, (4, n), generator=g))
               for n in lengths]
    torch.manual_seed(0)
    cpu = PerToken()
    tpu = copy.deepcopy(cpu)
    opt = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    want = []
    for x, y in batches:
        loss = nn.functional.cross_entropy(cpu(x).reshape(-1, 20), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    est = TPUEstimator(bucket_lengths=(8, 16), verbose=False)
    h = est.fit(tpu, batches, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    torch.testing.assert_close(torch.tensor(h.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_weights_equal(tpu, cpu)
    assert h.programs_compiled <= 6, h.programs_compiled  # 2 buckets, and the first step's optimizer init
    out = est.predict(tpu, [(x,) for x, _ in batches[:3]])
    assert [o.shape for o in out] == [(4, n, 20) for n in lengths[:3]]
    with torch.no_grad():
        torch.testing.assert_close(out[2], cpu(batches[2][0]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("per_sample", [True, False])
def test_custom_loss_fn_on_a_padded_last_batch(per_sample):
    """A loss_fn returning one loss per sample is masked (no new program for the last batch); a
    scalar loss_fn runs the last batch on its real rows. Both equal the unpadded CPU loop."""
    data = classification_data(100)
    cpu = mlp()
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(data, batch_size=32)
    want = cpu_reference(cpu, loader, nn.functional.cross_entropy, epochs=3)
    reduction = "none" if per_sample else "mean"
    loss_fn = lambda out, target: nn.functional.cross_entropy(out, target, reduction=reduction)
    seen = []
    history = TPUEstimator(verbose=False).fit(
        tpu.to("tpu"), loader, loss_fn=loss_fn, epochs=3,
        callbacks=[lambda est, logs: seen.append(torch_tpu.cache_stats()["misses"])])
    torch.testing.assert_close(torch.tensor(history.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_weights_equal(tpu, cpu)
    assert seen[2 if per_sample else 4] == seen[-1], seen


def test_batch_norm_last_batch_is_not_padded():
    """Padding rows would change BatchNorm's batch statistics: results equal the CPU loop, running
    statistics included."""
    data = classification_data(100)
    torch.manual_seed(0)
    # no bias before BatchNorm: its gradient is zero up to rounding, which AdamW would amplify
    cpu = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(data, batch_size=32)
    want = cpu_reference(cpu, loader, nn.functional.cross_entropy, epochs=2)
    history = TPUEstimator(verbose=False).fit(tpu.to("tpu"), loader, epochs=2)
    torch.testing.assert_close(torch.tensor(history.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_weights_equal(tpu, cpu)  # the state dict: running_mean and running_var too


# ---------------------------------------------------------------------- standard criteria as loss_fn
def _user_loss(pred, y):
    return nn.functional.cross_entropy(pred, y)


_CRITERIA = {
    "CrossEntropyLoss": (lambda: nn.CrossEntropyLoss(), nn.functional.cross_entropy),
    "F.cross_entropy": (lambda: nn.functional.cross_entropy, nn.functional.cross_entropy),
    "def loss(pred, y)": (lambda: _user_loss, nn.functional.cross_entropy),
    "CrossEntropyLoss(none)": (lambda: nn.CrossEntropyLoss(reduction="none"), nn.functional.cross_entropy),
    "CrossEntropyLoss(weight)": (
        lambda: nn.CrossEntropyLoss(weight=torch.tensor([0.3, 1.7])),
        lambda out, y, reduction="mean": nn.functional.cross_entropy(out, y, weight=torch.tensor([0.3, 1.7]))),
    "F.mse_loss": (lambda: nn.functional.mse_loss, nn.functional.mse_loss),
    "MSELoss(none)": (lambda: nn.MSELoss(reduction="none"), nn.functional.mse_loss),
}


@pytest.mark.parametrize("name", list(_CRITERIA))
def test_standard_criteria_match_cpu_on_a_padded_last_batch(name):
    """Any torch criterion of (outputs, target): a mean-reduced one runs the padded last batch again
    on its real rows, a per-sample one (reduction="none") is masked. Both equal the unpadded CPU loop."""
    make, cpu_loss = _CRITERIA[name]
    regression = "mse" in name.lower()
    data = regression_data(100) if regression else classification_data(100)
    cpu = mlp(out=1 if regression else 2)
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(data, batch_size=32)  # a last batch of 4
    if name == "CrossEntropyLoss(weight)":  # a weighted mean: per batch, not a sum over rows
        opt = torch.optim.AdamW(cpu.parameters(), lr=1e-3)
        want = []
        for _ in range(2):
            for x, y in loader:
                loss = cpu_loss(cpu(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                want.append(loss.item())
    else:
        want = cpu_reference(cpu, loader, cpu_loss, epochs=2)
    h = TPUEstimator(verbose=False).fit(tpu, loader, loss_fn=make(), epochs=2)
    torch.testing.assert_close(torch.tensor(h.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_weights_equal(tpu, cpu)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_criterion_with_gradient_accumulation_and_a_short_last_group(reduction):
    """Micro-batches of 16, 16, ..., 16 and 4, two per step: each step's loss is the mean over the
    real samples of its micro-batches, as on CPU."""
    data = regression_data(84)
    cpu = mlp(out=1)
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(data, batch_size=16)
    want = cpu_reference(cpu, loader, nn.functional.mse_loss, accum=2)
    h = TPUEstimator(verbose=False).fit(tpu, loader, loss_fn=nn.MSELoss(reduction=reduction), grad_accum_steps=2)
    torch.testing.assert_close(torch.tensor(h.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_weights_equal(tpu, cpu)


def test_criterion_in_compile_mode_and_in_evaluate():
    torch._dynamo.reset()
    data = classification_data(100)
    cpu = mlp()
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(data, batch_size=32)
    want = cpu_reference(cpu, loader, nn.functional.cross_entropy)
    est = TPUEstimator(mode="compile", verbose=False)
    h = est.fit(tpu, loader, loss_fn=nn.CrossEntropyLoss())
    torch.testing.assert_close(torch.tensor(h.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_weights_equal(tpu, cpu)
    x, y = data.tensors
    with torch.no_grad():
        ref = nn.functional.cross_entropy(cpu(x), y).item()
    for crit in (nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="none")):
        got = TPUEstimator(verbose=False).evaluate(tpu, loader, loss_fn=crit)
        assert got["loss"] == pytest.approx(ref, rel=1e-5)
    torch._dynamo.reset()


class _TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x):
        y = self.lin(x)
        return y, y.detach()


@pytest.mark.parametrize("mode", ["auto", "compile"])
def test_a_loss_that_cannot_take_the_batch_names_the_signatures(mode):
    """The issue's case: F.mse_loss on a model returning a tuple failed with "AttributeError: 'tuple'
    object has no attribute 'size'" from inside torch."""
    torch._dynamo.reset()
    x, y = regression_data(32).tensors
    est = TPUEstimator(mode=mode, verbose=False)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    with pytest.raises(LossConfigError, match=r"loss_fn\(outputs, target\).*outputs=tuple\(Tensor\(float32\[16, 1\]\)"
                                              r".*AttributeError.*batch_loss\(fn\)"):
        est.fit(_TupleOut(), loader, loss_fn=nn.functional.mse_loss)
    torch._dynamo.reset()


def test_loss_fn_errors():
    x, y = classification_data(32).tensors
    est = TPUEstimator(verbose=False)
    # no target in a single-tensor batch: the whole-batch form is named
    with pytest.raises(LossConfigError, match=r"needs a target.*batch_loss\(fn\) with fn\(outputs, batch\)"):
        est.fit(nn.Linear(8, 8), DataLoader(x, batch_size=16), loss_fn=nn.functional.mse_loss)
    # a function of one argument
    with pytest.raises(LossConfigError, match=r"cannot be called.*TypeError.*loss_fn\(outputs, target\)"):
        est.fit(mlp(), DataLoader(TensorDataset(x, y), batch_size=16), loss_fn=lambda out: out.sum())
    # neither a scalar nor one loss per sample
    with pytest.raises(LossConfigError, match=r"shape \(3,\) for a batch of 16 rows"):
        est.fit(mlp(), DataLoader(TensorDataset(x, y), batch_size=16), loss_fn=lambda out, t: out.sum(0).repeat(2)[:3])
    with pytest.raises(LossConfigError, match="returned float"):
        est.fit(mlp(), DataLoader(TensorDataset(x, y), batch_size=16), loss_fn=lambda out, t: 1.0)
    with pytest.raises(TypeError, match="loss_fn: expected a callable"):
        est.fit(mlp(), DataLoader(TensorDataset(x, y), batch_size=16), loss_fn="mse")
    assert issubclass(LossConfigError, TypeError)


def test_batch_loss_and_dict_labels_as_target():
    """batch_loss(fn) gets the whole batch; a plain loss_fn takes a dict batch's "labels"."""
    x, y = classification_data(64).tensors
    seen = []

    def whole(out, batch):
        seen.append(type(batch).__name__)
        xb, yb = batch
        return nn.functional.cross_entropy(out, yb) + 0 * xb.sum()

    cpu = mlp()
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    want = cpu_reference(cpu, loader, nn.functional.cross_entropy)
    h = TPUEstimator(verbose=False).fit(tpu, loader, loss_fn=batch_loss(whole))
    torch.testing.assert_close(torch.tensor(h.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert set(seen) == {"tuple"}

    class DictModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, features, labels):
            return self.net(features)

    dicts = [{"features": x[i : i + 16], "labels": y[i : i + 16]} for i in range(0, 64, 16)]
    torch.manual_seed(0)
    m = DictModel()
    ref = copy.deepcopy(m)
    h = TPUEstimator(verbose=False).fit(m, dicts, loss_fn=nn.CrossEntropyLoss())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for d in dicts:
        nn.functional.cross_entropy(ref(**d), d["labels"]).backward()
        opt.step()
        opt.zero_grad()
    assert_weights_equal(m, ref)


# ---------------------------------------------------------------------- prediction programs
@pytest.mark.parametrize("mode", ["auto", "compile"])
def test_predict_with_a_ragged_last_batch_compiles_once_per_bucket(mode):
    """Every program a pass needs is built by the first batch of each shape bucket: after a pass
    over one batch per bucket, a pass over the whole loader, its ragged last batch included,
    compiles nothing (cache_stats() and metrics() counts together)."""
    from torch_tpu.estimator.execution import compile_counters

    def compiles(est, model, batches):
        c0 = compile_counters()[0]
        out = est.predict(model, batches)
        return compile_counters()[0] - c0, out

    x = classification_data(100).tensors[0]
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 3)).to("tpu")  # shapes no other test has
    est = TPUEstimator(mode=mode, verbose=False)
    batches = [(x[i : i + 32],) for i in range(0, 100, 32)]  # 32, 32, 32 and 4
    first, _ = compiles(est, model, batches[:1])
    rest, out = compiles(est, model, batches)
    assert first >= 1 and rest == 0, (first, rest)
    with torch.no_grad():
        torch.testing.assert_close(out, copy.deepcopy(model).cpu()(x), rtol=RTOL, atol=ATOL)

    class PerToken(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(21, 8), nn.Linear(8, 21)

        def forward(self, idx):
            return self.out(self.emb(idx))

    g = torch.Generator().manual_seed(5)
    lengths = (3, 7, 5, 12, 16, 9, 6)
    batches = [(torch.randint(0, 21, (4 if i < 6 else 2, n), generator=g),) for i, n in enumerate(lengths)]
    est = TPUEstimator(bucket_lengths=(8, 16), mode=mode, verbose=False)
    lm = PerToken().to("tpu")
    first, _ = compiles(est, lm, [batches[0], batches[3]])  # buckets 8 and 16
    rest, out = compiles(est, lm, batches)
    assert first >= 2 and rest == 0, (first, rest)
    assert [tuple(o.shape) for o in out] == [(b[0].shape[0], b[0].shape[1], 21) for b in batches]
    with torch.no_grad():
        torch.testing.assert_close(out[-1], copy.deepcopy(lm).cpu()(batches[-1][0]), rtol=RTOL, atol=ATOL)
    if mode == "compile":  # one program per bucket, not one per op
        assert first <= 2 * 2, first
    torch._dynamo.reset()


# ---------------------------------------------------------------------- mode="auto": capture and replay
def _cpu_loop(model, loader, make_opt, make_sched=None, accum=1, epochs=1, clip=None, on_step=None):
    """The plain CPU loop of fit's default loss (cross entropy over the real rows of each step)."""
    opt = make_opt(model.parameters())
    sched = make_sched(opt) if make_sched else None
    losses, step = [], 0
    for _ in range(epochs):
        batches = list(loader)
        for i in range(0, len(batches), accum):
            group = batches[i : i + accum]
            n = sum(len(y) for _, y in group)
            total = 0.0
            for x, y in group:
                part = nn.functional.cross_entropy(model(x), y, reduction="sum") / n
                part.backward()
                total += part.item()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            losses.append(total)
            step += 1
            if on_step is not None:
                on_step(step, model, opt)
    return losses


_REPLAYED = {
    "SGD+StepLR": (lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9, weight_decay=0.01),
                   lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5), 1),
    "AdamW+ExponentialLR": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
                            lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.8), 1),
    "Adam+LambdaLR, accumulation": (lambda p: torch.optim.Adam(p, lr=1e-2),
                                    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)), 2),
    "RMSprop": (lambda p: torch.optim.RMSprop(p, lr=1e-3), None, 1),
}


@pytest.mark.parametrize("name", list(_REPLAYED))
def test_replay_matches_cpu_with_schedulers_accumulation_and_a_ragged_last_batch(name):
    """mode="auto": one fused warm-up step, then each bucket (full steps; the ragged last one) is
    captured once and replayed. Losses, learning rates and weights equal the CPU loop's over 3
    epochs, with the scheduler changing the learning rate between replays."""
    make_opt, make_sched, accum = _REPLAYED[name]
    data = classification_data(100)
    cpu = mlp()
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(data, batch_size=16)  # six of 16 and a last one of 4
    want = _cpu_loop(cpu, loader, make_opt, make_sched, accum=accum, epochs=3, clip=0.5)
    seen = []
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", torch_tpu.estimator.ReplayFallback)
        h = TPUEstimator(verbose=False).fit(
            tpu, loader, optimizer=make_opt, scheduler=make_sched, grad_accum_steps=accum, epochs=3, clip_grad_norm=0.5,
            callbacks=[lambda est, logs: seen.append(logs["loss"])])
    torch.testing.assert_close(torch.tensor(h.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert seen == h.loss  # a callback that reads the logs gets each step's loss
    assert_weights_equal(tpu, cpu)
    steps = len(want)
    assert h.execution == "replay" and h.replay_fallback is None
    assert h.graphs_captured == 2 and h.replayed_steps == steps - 1, (h.graphs_captured, h.replayed_steps)
    if make_sched is not None:
        sched = make_sched(make_opt(mlp().parameters()))
        lrs = []
        for _ in range(steps):
            lrs.append(sched.get_last_lr()[0])
            sched.optimizer.step()
            sched.step()
        assert [s["lr"] for s in h.steps] == pytest.approx(lrs)


def test_fused_and_compile_modes_do_not_replay():
    torch._dynamo.reset()
    loader = DataLoader(classification_data(64), batch_size=16)
    for mode in ("fused", "compile", "strict"):
        h = TPUEstimator(mode=mode, verbose=False).fit(mlp(), loader)
        assert (h.execution, h.replayed_steps, h.graphs_captured) == (mode, 0, 0)
    assert "mode='auto'" in repr(TPUEstimator(verbose=False))
    torch._dynamo.reset()


class _NotCapturable(torch.optim.SGD):
    """An optimizer of the user's own (outside torch.optim): nothing says it can be captured."""


def _host_read_loss(out, y):
    loss = nn.functional.cross_entropy(out, y)
    if loss.item() > 1e6:  # a host read: fine eagerly, refused by capture
        raise AssertionError("diverged")
    return loss


def _masked_loss(out, y):
    per = nn.functional.cross_entropy(out, y, reduction="none")
    return per[torch.nonzero(y >= 0).squeeze(1)].mean()  # the indices' count depends on the values


class _Freeze(Callback):
    """Changes what the captured step froze: momentum at step 3 (a Python number in the graph)."""

    def __init__(self, opts):
        self.opts = opts

    def on_step_end(self, est, logs):
        if logs["step"] == 3:
            self.opts[-1].param_groups[0]["momentum"] = 0.5


class _FreezeLayer(Callback):
    """Freezes the first layer's weight at step 3 (fine-tuning's usual move): the captured step's
    gradients and updates were fixed for the parameters that required grad at capture."""

    def on_step_end(self, est, logs):
        if logs["step"] == 3:
            self.model[0].weight.requires_grad_(False)


_OPTS: list = []  # the optimizers the fallback test's factory made, for _Freeze
_FALLBACKS = {
    "a host read in the loss": (dict(loss_fn=_host_read_loss), r"_local_scalar_dense.*cannot be captured"),
    "a data-dependent shape": (dict(loss_fn=_masked_loss),
                               r"aten\.nonzero.*cannot be captured: its output's shape depends"),
    "an optimizer that cannot be made capturable": (dict(optimizer=lambda p: _NotCapturable(p, lr=0.1)),
                                                    r"_NotCapturable cannot be made capturable"),
    "Adagrad": (dict(optimizer=lambda p: torch.optim.Adagrad(p, lr=0.1)), r"Adagrad cannot be made capturable"),
    "a callback that changes a frozen number": (dict(callbacks=[_Freeze(_OPTS)]),
                                                r"param group 0's 'momentum' changed between steps"),
    "a callback that freezes a layer": (dict(callbacks=[_FreezeLayer()]),
                                        r"which parameters require grad changed between steps"),
}


@pytest.mark.parametrize("cause", list(_FALLBACKS))
def test_replay_falls_back_to_fused_mode_once_with_the_reason(cause):
    """What cannot be captured runs in fused mode, with one ReplayFallback warning naming the cause;
    the results are CPU's either way."""
    kw, reason = _FALLBACKS[cause]
    data = classification_data(100)
    cpu = mlp()
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(data, batch_size=16)
    make_opt = kw.get("optimizer", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    cpu_opt = (lambda p: torch.optim.SGD(p, lr=0.1)) if "optimizer" in kw and "Adagrad" not in cause else make_opt
    if "Adagrad" in cause:
        cpu_opt = lambda p: torch.optim.Adagrad(p, lr=0.1)  # noqa: E731

    def on_step(step, model, opt):
        if "frozen number" in cause and step == 3:
            opt.param_groups[0]["momentum"] = 0.5
        if "freezes a layer" in cause and step == 3:
            model[0].weight.requires_grad_(False)

    want = _cpu_loop(cpu, loader, cpu_opt, epochs=2, on_step=on_step)
    est = TPUEstimator(verbose=False)

    def factory(p):
        _OPTS.append(make_opt(p))
        return _OPTS[-1]

    fit_kw = {k: v for k, v in kw.items() if k != "optimizer"}
    for c in fit_kw.get("callbacks", ()):
        c.model = tpu
    with pytest.warns(torch_tpu.estimator.ReplayFallback, match=reason) as caught:
        h = est.fit(tpu, loader, optimizer=factory, epochs=2, **fit_kw)
    assert len([w for w in caught if issubclass(w.category, torch_tpu.estimator.ReplayFallback)]) == 1
    torch.testing.assert_close(torch.tensor(h.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_weights_equal(tpu, cpu)
    assert h.execution == "fused" and re.search(reason, h.replay_fallback)


def test_replayed_checkpoints_resume_exactly_across_modes(tmp_path):
    """A run interrupted under replay and resumed equals the uninterrupted one (dropout included:
    the capture draws no random numbers of its own); so does a fused run's checkpoint resumed by
    mode="auto" (its optimizer state is made capturable on loading)."""
    data = classification_data(80)

    def run(ckdir, mode="auto", stop=None):
        torch.manual_seed(3)
        loader = DataLoader(data, batch_size=16, shuffle=True)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 2))
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.normal_(p, std=0.3)
        est = TPUEstimator(verbose=False, mode=mode)
        kw = dict(epochs=3, checkpoint_dir=ckdir, scheduler=lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), callbacks=[_StopAt(stop)] if stop else [])
        try:
            return est.fit(model, loader, **kw), model
        except KeyboardInterrupt:
            return None, model

    full, m_full = run(str(tmp_path / "a"))
    assert full.execution == "replay" and full.replayed_steps == 14
    for first_mode, stop in (("auto", 4), ("fused", 7)):
        d = str(tmp_path / f"{first_mode}-{stop}")
        assert run(d, first_mode, stop=stop)[0] is None
        resumed, m_res = run(d)
        assert resumed.execution == "replay"
        torch.testing.assert_close(torch.tensor(resumed.loss), torch.tensor(full.loss), rtol=1e-5, atol=1e-6)
        assert_weights_equal(m_res, m_full, rtol=1e-5, atol=1e-6)


def test_a_loader_of_tpu_tensors_is_not_overwritten_by_replay():
    """Replay re-points the captured batch's tensors at each new batch's arrays: they are the
    estimator's own, so batches the loader holds on the device keep their values."""
    x, y = classification_data(64).tensors
    batches = [(x[i : i + 16].to("tpu"), y[i : i + 16].to("tpu")) for i in range(0, 64, 16)]
    before = [(a.cpu(), b.cpu()) for a, b in batches]
    cpu = mlp()
    tpu = copy.deepcopy(cpu)
    want = _cpu_loop(cpu, [(a.cpu(), b.cpu()) for a, b in batches], lambda p: torch.optim.AdamW(p, lr=1e-3), epochs=2)
    h = TPUEstimator(verbose=False).fit(tpu, batches, epochs=2)
    assert h.execution == "replay" and h.replayed_steps == 7
    torch.testing.assert_close(torch.tensor(h.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    for (a, b), (ca, cb) in zip(batches, before):
        assert torch.equal(a.cpu(), ca) and torch.equal(b.cpu(), cb)


def test_replayed_adam_keeps_its_step_counts_in_one_array_each_with_its_own_value():
    """mode="auto" makes the per-parameter step counts of a capturable Adam views of one vector
    (one array in and out of the replayed step instead of one per parameter). Each is still a
    0-dim tensor counting the steps, the weights are CPU's, and the optimizer's state_dict saves
    and loads as before."""
    import io

    data = classification_data(64)
    cpu = mlp()
    tpu = copy.deepcopy(cpu)
    loader = DataLoader(data, batch_size=16)
    want = _cpu_loop(cpu, loader, lambda p: torch.optim.AdamW(p, lr=1e-2), epochs=2)
    opts: list = []
    h = TPUEstimator(verbose=False).fit(tpu, loader, epochs=2,
                                        optimizer=lambda p: opts.append(torch.optim.AdamW(p, lr=1e-2)) or opts[-1])
    assert h.execution == "replay"
    torch.testing.assert_close(torch.tensor(h.loss), torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert_weights_equal(tpu, cpu)
    steps = [s["step"] for s in opts[-1].state.values()]
    assert len(steps) == len(list(tpu.parameters())) > 1
    assert len({id(t.untyped_storage()) for t in steps}) == 1  # one array
    assert all(t.dim() == 0 and t.dtype == torch.float32 and t.device.type == "tpu" for t in steps)
    assert [float(t) for t in steps] == [8.0] * len(steps)  # 4 batches x 2 epochs
    buf = io.BytesIO()
    torch.save(opts[-1].state_dict(), buf)
    buf.seek(0)
    again = torch.optim.AdamW(tpu.parameters(), lr=1e-2)
    again.load_state_dict(torch.load(buf, weights_only=True))
    loaded = [s["step"] for s in again.state.values()]
    assert [float(t) for t in loaded] == [8.0] * len(steps)
    loaded[0].add_(1)  # each its own count
    assert [float(t) for t in loaded] == [9.0] + [8.0] * (len(steps) - 1)
