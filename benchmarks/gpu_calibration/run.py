"""GPU calibration: what one NVIDIA GPU reaches on the planner's own model graphs, against the device profile.

The planner prices a layer at ``peak(dtype) x efficiency`` FLOP/s (docs/cost-model.md, "Device speeds"),
and every pass at ``action_overhead_s``. Both figures were taken from papers or assumed. This script
measures them on a real GPU:

- *matmul*: an 8192^3 matrix product in bfloat16 and in float32 on TF32 tensor cores, the ceiling any
  model reaches;
- *models*: training steps (forward, loss, backward, Adam update) of ResNet50 (torchvision, random
  weights and synthetic images) and of a GPT-2 small backbone (12 pre-LayerNorm decoder blocks, d = 768,
  128 tokens, random tokens), in float32 (TF32 on, as TensorFlow has by default) and in bfloat16
  autocast, at two batch sizes. The *efficiency the planner would need* to predict each measured step
  is (the planner graph's training FLOPs per sample x samples/s) / the profile's peak for the dtype,
  with the FLOPs of the bundled graphs of benchmarks/planner_quality (ResNet50-b32-m8, GPT2-12-b32-m8,
  the counts of our profiler);
- *fixed cost per pass*: the time of a tiny forward and backward (so small that only launches and
  bookkeeping count), and of one kernel launch;
- *memory*: the allocator's peak during a step (allocated, and reserved with its rounding), the memory
  the CUDA context and the libraries take beside the tensors, and the device-to-device copy bandwidth.

The GPU machines this project is lent have PyTorch and no TensorFlow (TensorFlow's wheel alone is larger
than what may travel to them), so the steps run in PyTorch eager mode: the hardware's figures, not our
runtime's. Run there (the results JSON lands in the folder given):

    python3 benchmarks/gpu_calibration/run.py --measure --out results.json

and here, with the results beside this file, to rewrite the README's tables (no GPU needed):

    .venv/bin/python benchmarks/gpu_calibration/run.py --readme
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))  # the planner (pure Python) for the README's predictions
from benchmarks.readme import write_block  # noqa: E402

GRAPHS = ROOT / "benchmarks" / "planner_quality" / "graphs"
MODELS = {"ResNet50": "ResNet50-b32-m8.json", "GPT2-12": "GPT2-12-b32-m8.json"}
SEQUENCE_LENGTH = 128  # the tokens per sample of the GPT2-12 graph (benchmarks/planner_quality)
BATCHES = {"ResNet50": (64, 256), "GPT2-12": (32, 128)}
DTYPES = ("float32", "bfloat16")
PROFILE_DTYPE = {"float32": "tf32", "bfloat16": "bfloat16"}  # the peak the cost model prices each at


def graph_flops_per_sample(model: str) -> float:
    """Training FLOPs per sample (forward and backward) as the profiler counted them for the bundled graph."""
    graph = json.loads((GRAPHS / MODELS[model]).read_text())
    return sum(node["flops"] for node in graph["nodes"]) / graph["micro_batch_size"]


# --- measurement (PyTorch, on the GPU machine) -------------------------------------------------------


def _timed(torch: Any, step: Any, warmup: int, steps: int) -> float:
    """Seconds per call of ``step`` after ``warmup`` calls, the GPU drained before and after."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def _matmul(torch: Any) -> dict[str, float]:
    out = {}
    n = 8192
    for name, dtype in (("bfloat16", torch.bfloat16), ("tf32", torch.float32)):
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        seconds = _timed(torch, lambda a=a, b=b: a @ b, warmup=3, steps=10)
        out[name] = 2 * n**3 / seconds
        del a, b
    return out


def _gpt2(torch: Any) -> Any:
    nn = torch.nn
    functional = torch.nn.functional

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
            y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class Backbone(nn.Module):
        def __init__(self, vocabulary: int = 50257, layers: int = 12, d: int = 768, heads: int = 12) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocabulary, d)
            self.positions = nn.Embedding(SEQUENCE_LENGTH, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln = nn.LayerNorm(d)

        def forward(self, ids: Any) -> Any:
            x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            return self.ln(x)

    return Backbone()


def _model_step(torch: Any, model_name: str, batch: int, dtype: str) -> dict[str, Any]:
    """One configuration: seconds per training step, samples/s, torch's own FLOP count, peak memory."""
    if model_name == "ResNet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None).cuda()
        inputs = torch.randn(batch, 3, 224, 224, device="cuda")
        labels = torch.randint(0, 1000, (batch,), device="cuda")
        if dtype == "bfloat16":  # the layout cuDNN's bfloat16 kernels want
            model = model.to(memory_format=torch.channels_last)
            inputs = inputs.contiguous(memory_format=torch.channels_last)

        def loss_of() -> Any:
            return torch.nn.functional.cross_entropy(model(inputs), labels)
    else:
        model = _gpt2(torch).cuda()
        inputs = torch.randint(0, 50257, (batch, SEQUENCE_LENGTH), device="cuda")

        def loss_of() -> Any:
            return model(inputs).float().pow(2).mean()

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_of()
        loss.backward()
        optimizer.step()

    torch.cuda.reset_peak_memory_stats()
    seconds = _timed(torch, step, warmup=5, steps=20)
    peak = torch.cuda.max_memory_allocated()
    peak_reserved = torch.cuda.max_memory_reserved()  # what the caching allocator held: peak + its rounding
    kernels = None
    try:
        kernels = _kernel_seconds(torch, step)
    except Exception as error:  # a second reading; its absence must not lose the timing
        print(f"profiler failed: {error!r}", flush=True)
    counted = None
    try:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with counter:
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                loss = loss_of()
            loss.backward()
        counted = float(counter.get_total_flops()) / batch
    except Exception as error:  # the count is a cross-check; its absence must not lose the timing
        print(f"flop counter failed: {error!r}", flush=True)
    parameters = sum(p.numel() for p in model.parameters())
    model = optimizer = inputs = None  # freed before the next configuration allocates
    torch.cuda.empty_cache()
    return {
        "model": model_name,
        "batch": batch,
        "dtype": dtype,
        "step_s": seconds,
        "samples_per_s": batch / seconds,
        "torch_flops_per_sample": counted,
        "parameters": parameters,
        "peak_allocated_bytes": peak,
        "peak_reserved_bytes": peak_reserved,
        "kernel_s": kernels,
    }


def _kernel_seconds(torch: Any, step: Any, steps: int = 3) -> float:
    """GPU kernel time per call of ``step``, summed from the profiler's CUDA activity: the step's work
    without the gaps between kernels (launches, Python), since one stream runs one kernel at a time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    microseconds = sum(
        event.time_range.elapsed_us()
        for event in profiler.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    if microseconds <= 0:
        raise RuntimeError("the profiler recorded no CUDA activity")
    return float(microseconds) / 1e6 / steps


def _fixed_costs(torch: Any) -> dict[str, float]:
    x = torch.zeros(1, device="cuda")
    launches = 20000
    launch = _timed(torch, lambda: [x.add_(1) for _ in range(launches)], warmup=1, steps=3) / launches
    layer = torch.nn.Linear(64, 64).cuda()
    tiny = torch.randn(1, 64, device="cuda", requires_grad=True)

    def tiny_pass() -> None:
        layer(tiny).sum().backward()

    passes = 2000
    queued = _timed(torch, lambda: [tiny_pass() for _ in range(passes)], warmup=1, steps=3) / passes

    def synced_pass() -> None:
        tiny_pass()
        torch.cuda.synchronize()

    synced = _timed(torch, synced_pass, warmup=50, steps=passes)
    return {"kernel_launch_s": launch, "tiny_forward_backward_s": queued, "tiny_forward_backward_synced_s": synced}


def _context_bytes(torch: Any) -> int:
    """Device memory in use that no tensor holds, after cuBLAS and cuDNN have run: the CUDA context,
    the libraries' handles and workspaces (total - free - what the caching allocator reserved)."""
    a = torch.randn(256, 256, device="cuda")
    torch.nn.functional.conv2d(torch.randn(1, 3, 32, 32, device="cuda"), torch.randn(8, 3, 3, 3, device="cuda"))
    (a @ a).sum().item()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free - torch.cuda.memory_reserved())


def _copy_bandwidth(torch: Any) -> float:
    size = 2**30
    a = torch.empty(size, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    seconds = _timed(torch, lambda: b.copy_(a), warmup=3, steps=20)
    return 2 * size / seconds  # bytes read and written


def measure(out: Path) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True  # TensorFlow's default on Ampere and later
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True  # TensorFlow autotunes its convolutions too
    properties = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "total_memory_bytes": properties.total_memory,
        "multiprocessors": properties.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python3 benchmarks/gpu_calibration/run.py --measure",
        "errors": [],
        "models": [],
    }
    try:
        results["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except Exception as error:
        results["errors"].append(f"nvidia-smi: {error!r}")

    def save() -> None:
        out.write_text(json.dumps(results, indent=1) + "\n")

    parts = [
        ("context_bytes", _context_bytes),
        ("matmul_flops_per_s", _matmul),
        ("fixed_costs", _fixed_costs),
        ("copy_bytes_per_s", _copy_bandwidth),
    ]
    for key, part in parts:
        try:
            results[key] = part(torch)
            print(key, results[key], flush=True)
        except Exception:
            results["errors"].append(f"{key}: {traceback.format_exc(limit=3)}")
        save()
    for model, batches in BATCHES.items():
        for dtype in DTYPES:
            for batch in batches:
                try:
                    row = _model_step(torch, model, batch, dtype)
                    results["models"].append(row)
                    print(row, flush=True)
                except Exception:
                    results["errors"].append(f"{model} b{batch} {dtype}: {traceback.format_exc(limit=3)}")
                    torch.cuda.empty_cache()
                save()
    print("errors:", results["errors"], flush=True)


# --- README (pure Python, here) ----------------------------------------------------------------------


def _profile_for(device: str) -> str:
    """The bundled device profile of the GPU that ran, by its reported name."""
    if "H200" in device:
        return "H200-SXM-141GB"
    if "H100" in device:
        return "H100-SXM-80GB"
    raise SystemExit(f"No bundled device profile for {device!r}: add one to partitioner/hardware/devices.")


def planner_memory_bytes(model: str, batch: int, profile_name: str) -> int:
    """The planner's memory for the whole model on one device at ``batch``, M = 1, Adam (CostModel.evaluate)."""
    from partitioner.cluster import Cluster
    from partitioner.cost import CostModel
    from partitioner.graph import load_graph, rescale_graph

    graph = rescale_graph(load_graph(GRAPHS / MODELS[model]), batch, 1)
    cluster = Cluster.from_dict(
        {
            "schema_version": 1,
            "kind": "cluster",
            "name": profile_name,
            "device_profile": profile_name,
            "num_devices": 1,
            "bandwidth_bytes_per_s": 1e11,
        }
    )
    costs = CostModel(graph, cluster, num_microbatches=1, optimizer_slots=2)
    evaluation = costs.evaluate(dict.fromkeys(graph.nodes, cluster.devices[0].name))
    return int(max(evaluation.memory_bytes.values()))


def tables(results: dict[str, Any]) -> str:
    from partitioner.cluster import load_device_profile

    profile_name = _profile_for(results["device"])
    profile = load_device_profile(profile_name)
    peaks, efficiency = profile["peak_flops_per_s"], profile["efficiency"]
    lines = [
        f"Device: {results['device']} ({results['multiprocessors']} SMs, "
        f"{results['total_memory_bytes'] / 2**30:.1f} GiB, driver and max SM clock {results.get('driver', '?')}); "
        f"PyTorch {results['torch']}, CUDA {results['cuda']}, cuDNN {results['cudnn']}; eager mode. "
        f"Measured on {results['date']} by `{results['command']}`. Profile: `{profile_name}` "
        f"(efficiency {efficiency}).",
        "",
    ]
    matmul = results.get("matmul_flops_per_s")
    if matmul:
        lines += ["| 8192^3 matmul | TFLOP/s | share of the profile's peak |", "|---|---|---|"]
        for dtype, flops in matmul.items():
            lines.append(f"| {dtype} | {flops / 1e12:.0f} | {flops / peaks[dtype]:.2f} |")
        lines.append("")
    lines += [
        "| model | dtype | batch | step | samples/s | efficiency needed | predicted / measured step "
        "| GPU kernel time | efficiency needed | FLOPs/sample (ours / torch) | peak allocated | planner memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["models"]:
        ours = graph_flops_per_sample(row["model"])
        peak = peaks[PROFILE_DTYPE[row["dtype"]]]
        predicted = ours * row["batch"] / (peak * efficiency) + 2 * profile["action_overhead_s"]
        torch_count = row["torch_flops_per_sample"]
        ratio = f"{ours / torch_count:.2f}" if torch_count else "n/a"
        planned = (  # the bundled graphs are float32: their activations are float32 bytes
            f"{planner_memory_bytes(row['model'], row['batch'], profile_name) / 2**30:.2f} GiB"
            if row["dtype"] == "float32"
            else "(float32 graph)"
        )
        kernels = row.get("kernel_s")
        kernel_cells = (
            f"{kernels * 1e3:.1f} ms | {ours * row['batch'] / kernels / peak:.3f}" if kernels else "n/a | n/a"
        )
        lines.append(
            f"| {row['model']} | {row['dtype']} | {row['batch']} | {row['step_s'] * 1e3:.1f} ms "
            f"| {row['samples_per_s']:,.0f} | {ours * row['samples_per_s'] / peak:.3f} "
            f"| {predicted / row['step_s']:.2f} | {kernel_cells} | {ours / 1e9:.1f} G ({ratio}) "
            f"| {row['peak_allocated_bytes'] / 2**30:.2f} GiB | {planned} |"
        )
    fixed = results.get("fixed_costs")
    if fixed:
        lines += [
            "",
            f"Fixed costs: one kernel launch {fixed['kernel_launch_s'] * 1e6:.1f} us (20,000 queued); a tiny "
            f"forward and backward (Linear(64, 64), batch 1) {fixed['tiny_forward_backward_s'] * 1e6:.0f} us queued, "
            f"{fixed['tiny_forward_backward_synced_s'] * 1e6:.0f} us when each waits for the GPU; the profile "
            f"assumes {profile['action_overhead_s'] * 1e6:.0f} us per pass.",
        ]
    if results.get("context_bytes") is not None:
        lines.append(
            f"Memory no tensor holds once cuBLAS and cuDNN have run (CUDA context, handles, workspaces): "
            f"{results['context_bytes'] / 2**30:.2f} GiB of {results['total_memory_bytes'] / 2**30:.1f} GiB."
        )
    rounding = [
        f"{row['model']} {row['dtype']} b{row['batch']} {row['peak_reserved_bytes'] / row['peak_allocated_bytes']:.2f}x"
        for row in results["models"]
        if row.get("peak_reserved_bytes")
    ]
    if rounding:
        lines.append(
            "The caching allocator's peak reserve over its peak allocated (rounding and fragmentation): "
            + ", ".join(rounding)
            + "."
        )
    if results.get("copy_bytes_per_s"):
        lines.append(
            f"Device-to-device copy: {results['copy_bytes_per_s'] / 1e12:.2f} TB/s (bytes read and written; "
            f"the profile says {profile['memory_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s)."
        )
    if results["errors"]:
        lines += ["", "Errors: " + "; ".join(e.strip().splitlines()[-1] for e in results["errors"])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", action="store_true", help="run the measurements (needs PyTorch and a GPU)")
    mode.add_argument("--readme", action="store_true", help="rewrite README.md's tables from results.json")
    parser.add_argument("--out", type=Path, default=HERE / "results.json", help="where --measure writes")
    args = parser.parse_args()
    if args.measure:
        measure(args.out)
        return
    results = json.loads((HERE / "results.json").read_text())
    write_block(HERE / "README.md", "results", tables(results))


if __name__ == "__main__":
    main()
