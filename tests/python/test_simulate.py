"""`odc simulate`: its output, its errors, the PNG, and the same simulator through the C API
(odc.simulate.simulate). Its validation against the recorded runs: test_validate_runs.py."""

import ctypes
import json
import re
import subprocess
import sys

import pytest

from odc.simulate import parse_odc_bench, simulate as simulate_in_process, sweep, write_plot


def simulate(odc_cli, *arguments):
    return subprocess.run(
        [odc_cli, "simulate", *arguments], capture_output=True, text=True, timeout=120
    )


def test_the_c_api_gives_the_command_s_document(odc_cli, data_dir):
    # odcSimulate parses the command's options and returns its JSON document, in this process.
    lengths_file = data_dir / "aime_rl_like.txt"
    arguments = ["--ranks", "8", "--minibatches", "2", "--policies", "lb-micro,lb-mini"]
    command = simulate(odc_cli, "--lengths", str(lengths_file), *arguments, "--format", "json")
    assert command.returncode == 0, command.stderr
    expected = json.loads(command.stdout)
    assert simulate_in_process(["--lengths", str(lengths_file), *arguments]) == expected
    # The lengths may come from the caller instead of a file: the same document.
    lines = [line.strip() for line in lengths_file.read_text().splitlines()]
    lengths = [int(line) for line in lines if line and not line.startswith("#")]
    assert simulate_in_process(arguments, lengths) == expected
    # Refusals are ValueErrors carrying the command's message.
    cases = [
        (["--ranks", "8,x"], lengths, "'x' is not a positive integer"),
        (["--lengths", str(lengths_file)], lengths, "pass lengths or --lengths, not both"),
        (["--format", "table"], lengths, "the document is always JSON"),
        (["--ranks", "8"], [4096, 0], "lengths[1] is 0"),
        (["--ranks", "8"], None, "--lengths is required"),
    ]
    for case_arguments, case_lengths, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            simulate_in_process(case_arguments, case_lengths)
    # A pointer the library did not hand out is refused, never freed.
    from odc import _capi

    foreign = ctypes.create_string_buffer(b"{}")
    assert (
        _capi.lib.odcSimulateFree(ctypes.cast(foreign, ctypes.c_void_p)) == _capi.INVALID_ARGUMENT
    )
    assert _capi.lib.odcSimulateFree(None) == _capi.SUCCESS


def test_a_typed_request_gives_the_command_s_document(odc_cli, data_dir):
    # odcSimulateSweep: the same configuration as a typed request, the same document, byte for
    # byte parsed, as `odc simulate --format json` with the matching options.
    lengths_file = data_dir / "aime_rl_like.txt"
    lines = [line.strip() for line in lengths_file.read_text().splitlines()]
    lengths = [int(line) for line in lines if line and not line.startswith("#")]
    cases = [
        ([], {}),
        (
            ["--ranks", "8,16", "--minibatches", "2", "--policies", "lb-micro,lb-mini",
             "--modes", "collective,odc", "--split", "auto", "--cost", "3e-05,1.2e-09,0.07,0.3",
             "--cost-calibrated-on", "2", "--max-tokens", "40000", "--microbatch-memory", "cap"],
            dict(ranks=[8, 16], minibatches=2, policies=["lb-micro", "lb-mini"],
                 modes="collective,odc", split="auto", cost=(3e-05, 1.2e-09, 0.07, 0.3),
                 cost_calibrated_on=2, max_tokens=40000, microbatch_memory="cap"),
        ),
        (
            ["--ranks", "8", "--minibatches", "2", "--task", "grpo", "--minibatches-per-step",
             "4", "--forward-fraction", "0.3", "--layers", "4", "--layer-params", "1e8",
             "--other-params", "2e8", "--cost", "1e-05,1e-09,0.05", "--gpus-per-node", "4",
             "--network-gbits", "100", "--gpu-memory-gbytes", "20", "--samples-per-rank", "8"],
            dict(ranks=[8], minibatches=2, task="grpo", minibatches_per_step=4,
                 forward_fraction=0.3, layers=4, layer_params=1e8, other_params=2e8,
                 cost=(1e-05, 1e-09, 0.05), gpus_per_node=4, network_gbits=100,
                 gpu_memory_gbytes=20, samples_per_rank=8),
        ),
        (
            ["--ranks", "4", "--rank-speed", "1,1,0.5,1", "--minibatches", "1"],
            dict(ranks=[4], rank_speed=[1, 1, 0.5, 1], minibatches=1),
        ),
    ]  # fmt: skip
    for arguments, options in cases:
        if not arguments:  # the defaults, on fewer rank counts to stay quick
            arguments, options = (
                ["--ranks", "8", "--minibatches", "1"],
                dict(ranks=[8], minibatches=1),
            )
        command = simulate(odc_cli, "--lengths", str(lengths_file), *arguments, "--format", "json")
        assert command.returncode == 0, command.stderr
        assert sweep(lengths, **options) == json.loads(command.stdout), arguments
    # Refusals carry the command's words, or name the field.
    refusals = [
        (dict(ranks=[8], modes="nccl"), "unknown mode 'nccl'"),
        (dict(ranks=[8], layers=4), "needs all of --layers"),
        (dict(ranks=[8], task="rl"), "unknown task 'rl'"),
        (dict(ranks=[8], cost=(1, -1, 0)), "cost_a, cost_b, cost_c and cost_floor"),
        (dict(ranks=[8], rank_speed=[1, 1]), "--rank-speed gives 2 speeds"),
        (dict(ranks=[2], rank_speed=[1, 0]), "rank_speed[1] must be a finite number > 0"),
        (dict(ranks=[8], bogus=1), "no option 'bogus'"),
    ]
    for options, message in refusals:
        with pytest.raises(ValueError, match=re.escape(message)):
            sweep(lengths, **options)
    with pytest.raises(ValueError, match="lengths\\[1\\] is 0"):
        sweep([4096, 0], ranks=[8])


ODC_BENCH_SAMPLE = """odc-bench: 2 GPUs, NCCL 22809

gather (bf16) vs ncclAllGather (2 ranks; size = per-rank bytes; slowest rank; busbw = x)
      size       odc_us    odc_busbw      nccl_us   nccl_busbw  speedup   odc/nvl  check
      1MiB          5.3         99.5         11.0         47.8    2.08x     20.8%     ok
      1GiB       1628.3        329.7       1968.0        272.8    1.21x     69.0%     ok

scatter-accumulate (fp32 -> fp32), one push per minibatch incl. its begin/end barriers, vs x
      size       odc_us    odc_busbw      nccl_us   nccl_busbw  speedup   odc/nvl  check
      1MiB         16.2         32.3          9.9         53.0    0.61x      6.8%     ok

scatter-accumulate (fp32 -> fp32), back-to-back pushes in one open minibatch, vs x
      size       odc_us    odc_busbw      nccl_us   nccl_busbw  speedup   odc/nvl  check
      1MiB          4.6        113.0          9.9         53.0    2.13x     23.6%     ok
"""


# Since 2026-11-29: the device named in the header and NCCL's share of the links beside ODC's.
ODC_BENCH_SAMPLE_WITH_LINKS = """odc-bench: 4 x NVIDIA H200, NCCL 22803, odc transport cuda; \
links 450 GB/s per direction per GPU (nominal NVLink 4, 18 x 25 GB/s: H100 / H200 SXM)

gather (bf16) vs ncclAllGather (4 ranks; size = per-rank bytes; slowest rank; busbw = x)
      size       odc_us    odc_busbw      nccl_us   nccl_busbw  speedup  odc/link nccl/link  check
    512MiB       1249.6        322.2       1294.0        311.2    1.04x     71.6%     69.2%     ok

scatter-accumulate (fp32 -> fp32), back-to-back pushes in one open minibatch, vs x
      size       odc_us    odc_busbw      nccl_us   nccl_busbw  speedup  odc/link nccl/link  check
    512MiB       1430.2        281.5       1282.4        314.0    0.90x     62.6%     69.8%     ok
"""


def test_odc_bench_output_becomes_curves(odc_cli, data_dir, tmp_path):
    linked = parse_odc_bench(ODC_BENCH_SAMPLE_WITH_LINKS)
    assert linked["ranks"] == 4
    assert linked["curves"]["gather"] == [[512.0 * 2**20, 322.2]]
    assert linked["curves"]["reduce_scatter"] == [[512.0 * 2**20, 314.0]]
    document = parse_odc_bench(ODC_BENCH_SAMPLE)
    assert document["ranks"] == 2
    curves = document["curves"]
    assert curves["gather"] == [[2.0**20, 99.5], [2.0**30, 329.7]]
    assert curves["all_gather"] == [[2.0**20, 47.8], [2.0**30, 272.8]]
    # The strict (one push per minibatch) table is not the one training runs: skipped.
    assert curves["scatter"] == [[2.0**20, 113.0]]
    assert curves["reduce_scatter"] == [[2.0**20, 53.0]]
    with pytest.raises(ValueError, match="no table for: scatter, reduce_scatter"):
        parse_odc_bench(ODC_BENCH_SAMPLE.split("scatter-accumulate")[0])
    # odc simulate reads them, and names what is wrong with a bad file.
    good, bad = tmp_path / "curves.json", tmp_path / "bad.json"
    good.write_text(json.dumps(document))
    bad.write_text(json.dumps({"curves": {"gather": [[2.0**20, 1.0], [1.0, 2.0]]}}))
    lengths = str(data_dir / "aime_rl_like.txt")
    ok = simulate(odc_cli, "--lengths", lengths, "--ranks", "2", "--transport", str(good))
    assert ok.returncode == 0, ok.stderr
    result = simulate(odc_cli, "--lengths", lengths, "--ranks", "2", "--transport", str(bad))
    assert result.returncode == 2 and "sizes must increase" in result.stderr


def test_table_json_and_speedup(odc_cli, data_dir):
    common = [
        "--lengths", str(data_dir / "longalign_like.txt"), "--max-length", "65536",
        "--ranks", "8,64", "--minibatches", "3", "--policies", "lb-micro,lb-mini",
    ]  # fmt: skip
    table = simulate(odc_cli, *common)
    assert table.returncode == 0, table.stderr
    assert "speedup" in table.stdout and "odc-hybrid" in table.stdout
    result = simulate(odc_cli, *common, "--format", "json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    rows = document["results"]
    # Lockstep modes (collective, fsdp2-deferred) cannot run lb-mini: 2 rank counts x (lb-micro x
    # 5 modes + lb-mini x 3 modes).
    assert len(rows) == 16
    for row in rows:
        assert row["step_seconds"] > 0 and 0 <= row["bubble"] < 1
        parts = (
            row["compute_seconds"] + row["exposed_comm_seconds"] + row["idle_seconds"]
            + row["optimizer_seconds"]
        )  # fmt: skip
        assert parts == pytest.approx(row["step_seconds"], rel=1e-9)
        assert len(row["minibatch_seconds"]) == 3
        if row["mode"] == "collective":
            assert row["speedup"] == pytest.approx(1.0)
    # The same plan without per-layer lockstep: ODC never slower than collective on one node.
    by_key = {(r["ranks"], r["policy"], r["mode"]): r for r in rows}
    assert (
        by_key[(8, "lb-micro", "odc")]["step_seconds"]
        <= by_key[(8, "lb-micro", "collective")]["step_seconds"]
    )


def test_errors_name_the_problem(odc_cli, data_dir):
    lengths = str(data_dir / "longalign_like.txt")
    cases = [
        (["--lengths", lengths, "--ranks", "8,x"], "'x' is not a positive integer"),
        (["--lengths", lengths, "--modes", "nccl"], "unknown mode 'nccl'"),
        (["--lengths", lengths, "--model", "70b"], "unknown model preset '70b'"),
        (["--lengths", lengths, "--layers", "4"], "needs all of --layers"),
        (["--lengths", lengths, "--network-gbits", "0"], "bandwidths must be > 0"),
        # List-shaped mistakes: one line naming the option, the value typed and its form.
        (
            ["--lengths", lengths, "--ranks", "8", "16"],
            "--ranks takes a comma-separated list without spaces, got '8 16': --ranks 8,16",
        ),
        (
            ["--lengths", lengths, "--ranks=8", "--ranks=16"],
            "--ranks was given 2 times ('8', '16'): give it once, as a comma-separated list "
            "without spaces: --ranks 8,16",
        ),
        (
            ["--lengths", lengths, "--modes", "odc", "collective"],
            "--modes takes a comma-separated list without spaces, got 'odc collective'",
        ),
        (
            ["--lengths", lengths, "--minibatches", "2,4"],
            "--minibatches takes one integer, got '2,4'",
        ),
        (
            ["--lengths", lengths, "--gpu-memory-gbytes", "80,141"],
            "--gpu-memory-gbytes takes one number, got '80,141'",
        ),
        (["--lengths", "/nonexistent/lengths.txt"], "nonexistent"),
    ]
    for arguments, message in cases:
        result = simulate(odc_cli, *arguments)
        assert result.returncode == 2, arguments
        assert message in result.stderr, (arguments, result.stderr)
        assert len(result.stderr.splitlines()) == 1


def test_bad_sizes_and_files_are_one_line_errors(odc_cli, data_dir, tmp_path, monkeypatch):
    # Each of these once aborted (SIGABRT), overflowed into a negative minibatch size or ran
    # without end; each is now one line naming the argument, status 2.
    lengths = str(data_dir / "longalign_like.txt")
    int64_max = str(2**63 - 1)
    cases = [
        (["--transport", str(tmp_path)], "is a directory"),
        (["--samples-per-rank", "1000000000", "--minibatches", "1000000000"], "--minibatches"),
        (["--samples-per-rank", int64_max], f"--samples-per-rank {int64_max}"),
        (["--minibatches", int64_max], f"--minibatches {int64_max}"),
        (["--samples-per-rank", "1" + "0" * 19], "--samples-per-rank: '1" + "0" * 19 + "' is out"),
        (["--cost-calibrated-on", "1000000000"], "--cost-calibrated-on must be 0 to 1024"),
        (["--cost-calibrated-on", "1e9"], "--cost-calibrated-on"),
        (["--ranks", "70000"], "--ranks: 70000 is above 65536"),
        (
            ["--layers", "1000000000000", "--layer-params", "1", "--other-params", "1"]
            + ["--cost", "1,0,0"],
            "--layers must be 1 to 10000",
        ),
        (
            ["--layers", "28", "--layer-params", "1e308", "--other-params", "1"]
            + ["--cost", "1,0,0"],
            "parameter counts are too large",
        ),
    ]
    for arguments, message in cases:
        ranks = [] if "--ranks" in arguments else ["--ranks", "8"]
        result = simulate(odc_cli, "--lengths", lengths, *ranks, *arguments)
        lines = result.stderr.splitlines()
        assert result.returncode == 2, (arguments, result.stderr)
        assert len(lines) == 1 and lines[0].startswith("odc simulate: error: "), lines
        assert message in lines[0], (arguments, lines)
    # The Python front end passes the line and the status through.
    monkeypatch.setenv("ODC_CLI", odc_cli)
    command = [sys.executable, "-m", "odc.simulate", "--lengths", lengths, "--ranks", "8"]
    result = subprocess.run(
        [*command, "--transport", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"odc simulate: error: transport curves '{tmp_path}' is a directory, not a file"
    ]


def test_decision_and_memory(odc_cli, data_dir):
    # The table ends with one decision line (within 160 characters, naming the GPU memory it
    # assumed) and one line of why; the JSON carries both in "decision"; memory per GPU per layout.
    common = ["--lengths", str(data_dir / "aime_rl_like.txt"), "--ranks", "8,16"]
    common += ["--minibatches", "2", "--policies", "lb-micro,lb-mini"]
    table = simulate(odc_cli, *common)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    decision, why = lines[-2:]
    assert decision.startswith("decision: ") and why.startswith("why (at 8 GPUs): ")
    assert len(decision) <= 160
    assert decision.endswith("(141 GB/GPU, default --gpu-memory-gbytes)")
    assert not any(line.startswith(("verdict:", "hint:")) for line in lines)
    assert "includes modelled communication (NVLink 290 GB/s" in table.stdout
    document = json.loads(simulate(odc_cli, *common, "--format", "json").stdout)
    assert document["decision"]["text"] == decision and document["decision"]["reason"] == why
    assert document["decision"]["gpu_memory_bytes"] == 141e9
    # Each rank count's entry against the rows: ODC's fastest arm over FSDP2's, both fitting.
    rows = document["results"]
    for entry in document["decision"]["by_ranks"]:
        at = [r for r in rows if r["ranks"] == entry["ranks"]]
        step = {f"{r['mode']} + {r['policy']}": r["step_seconds"] for r in at}
        odc = min((r for r in at if r["mode"].startswith("odc")), key=lambda r: r["step_seconds"])
        assert entry["odc_arm"] == f"{odc['mode']} + {odc['policy']}"
        assert entry["gain"] == pytest.approx(step[entry["baseline"]] / odc["step_seconds"])
        assert entry["use_odc"] == (entry["gain"] >= 1.03)
    memory = {(row["ranks"], row["mode"]): row for row in document["memory_per_gpu"]}
    modes = ("collective", "fsdp2-deferred", "fsdp2-unsharded", "odc", "odc-hybrid")
    assert set(memory) == {(n, m) for n in (8, 16) for m in modes}
    for row in memory.values():
        parts = row["state_bytes"] + row["gathered_bytes"] + row["unsharded_bytes"]
        parts += row["odc_bytes"]
        assert row["total_bytes"] == pytest.approx(parts)
    # Flat ODC shards over all GPUs, the hybrid over a node's 8; across nodes flat ODC holds the
    # staging and the node cache.
    assert memory[(16, "odc-hybrid")]["state_bytes"] == pytest.approx(
        2 * memory[(16, "odc")]["state_bytes"]
    )
    assert memory[(8, "odc")]["odc_bytes"] == 0 < memory[(16, "odc")]["odc_bytes"]
    assert "memory per GPU" in table.stdout and "fits?" in table.stdout
    # odc.torch publishes FSDP2's fp32 shards in place: ODC's state is FSDP2's 16 B per
    # parameter, not 18 (no bf16 copy); the node cache holds fp32 shards (4 B per parameter).
    model = document["model"]
    params = model["other_params"] + model["layers"] * model["layer_params"]
    for n in (8, 16):
        assert memory[(n, "odc")]["state_bytes"] == pytest.approx(16 * params / n)
        assert memory[(n, "odc")]["state_bytes"] == memory[(n, "collective")]["state_bytes"]
    staging = cache_budget = 256 * 2**20
    assert memory[(16, "odc")]["odc_bytes"] == pytest.approx(
        staging + min(cache_budget, 4 * params / 16)
    )
    assert "18 B" not in table.stdout and "bf16 copy" not in table.stdout


def test_split_auto_and_the_split_check(odc_cli, data_dir):
    # simulate takes --split auto (the split plans, simulated: ODC's and FSDP2's alike) and,
    # without it, its why names where splitting would pay: on heavy_tailed.txt ODC without split
    # gains too little to be worth it, and with split it wins over FSDP2 with split.
    common = ["--lengths", str(data_dir / "heavy_tailed.txt"), "--ranks", "8"]
    common += ["--minibatches", "4", "--policies", "lb-micro,lb-mini"]
    table = simulate(odc_cli, *common)
    assert table.returncode == 0, table.stderr
    decision, why = table.stdout.splitlines()[-2:]
    assert decision.startswith("decision: use FSDP2 (fsdp2-unsharded + lb-micro) at 8 GPUs: ")
    (gain,) = re.findall(r"rerun with --split auto: splitting outliers made odc \+ lb-mini "
                         r"([0-9.]+)x faster at 8 GPUs", why)  # fmt: skip
    split = json.loads(simulate(odc_cli, *common, "--split", "auto", "--format", "json").stdout)
    assert split["split"] == "auto"
    chosen = split["decision"]
    assert chosen["use_odc"] and chosen["arm"] == "odc + lb-mini+split" and chosen["split"]
    assert chosen["baseline"] == "fsdp2-unsharded + lb-micro+split" and chosen["gain"] > 1.1
    assert "splitting outliers is the win: without split ODC gains " in chosen["reason"]
    rows = {(r["policy"], r["mode"]): r for r in split["results"]}
    assert ("lb-mini+split", "odc") in rows and ("lb-micro+split", "collective") in rows
    assert ("lb-mini+split", "collective") not in rows
    # The why's figure is the split arm's simulated speedup over the unsplit one.
    assert rows[("lb-mini", "odc")]["step_seconds"] / rows[("lb-mini+split", "odc")][
        "step_seconds"
    ] == pytest.approx(float(gain), abs=0.006)
    # --rank-speed names every rank, so it takes one rank count of that many ranks.
    slow = simulate(odc_cli, *common, "--rank-speed", "1,1,1,1,1,1,1,0.5", "--format", "json")
    assert slow.returncode == 0, slow.stderr
    assert json.loads(slow.stdout)["rank_speed"][-1] == 0.5
    wrong = simulate(odc_cli, *common, "--rank-speed", "1,1")
    assert wrong.returncode == 2
    assert wrong.stderr.strip().endswith("simulate one rank count with --ranks 2")


def test_plot(odc_cli, data_dir, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("ODC_CLI", odc_cli)
    monkeypatch.setenv("ODC_PYTHON", sys.executable)
    png = tmp_path / "speedup.png"
    arguments = ["--lengths", str(data_dir / "aime_rl_like.txt"), "--ranks", "8,16"]
    arguments += ["--minibatches", "2"]
    result = simulate(odc_cli, *arguments, "--plot", str(png))
    assert result.returncode == 0, result.stderr
    assert f"plot: {png}" in result.stdout and png.read_bytes()[:4] == b"\x89PNG"
    # python -m odc.simulate passes --plot through.
    png.unlink()
    command = [sys.executable, "-m", "odc.simulate", *arguments, "--plot", str(png)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "speedup" in result.stdout and png.stat().st_size > 1000
    assert write_plot({"results": []}, str(tmp_path / "empty.png")) == str(tmp_path / "empty.png")


def test_plot_errors_are_one_line(odc_cli, data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ODC_CLI", odc_cli)
    lengths = ["--lengths", str(data_dir / "aime_rl_like.txt"), "--ranks", "8"]
    bad = str(tmp_path / "missing" / "speedup.png")
    message = f"cannot write the plot to '{bad}': no directory '{tmp_path / 'missing'}'"
    for command in (
        [odc_cli, "simulate", *lengths, "--plot", bad],
        [sys.executable, "-m", "odc.simulate", *lengths, "--plot", bad],
        [odc_cli, "compare", *lengths, "--plot", bad],
    ):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, command
        (line,) = result.stderr.splitlines()
        assert line.endswith(message), line
    # The drawer's own failure is one line too (a traceback of 15 before).
    result = subprocess.run(
        [sys.executable, "-m", "odc.simulate", "--draw", bad],
        input='{"results": []}', capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and len(result.stderr.splitlines()) == 1, result.stderr


def test_empty_plot_path_is_refused_naming_the_option(odc_cli, data_dir, capfd, monkeypatch):
    # `--plot ""` (an unset shell variable) was taken as "no plot": the run succeeded and drew
    # nothing. Refused before any simulation, like every other unwritable path.
    from odc.simulate import main

    monkeypatch.setenv("ODC_CLI", odc_cli)
    lengths = ["--lengths", str(data_dir / "aime_rl_like.txt"), "--ranks", "8"]
    message = "--plot needs a file name, got '' (e.g. --plot speedup.png)"
    for command, program in (("simulate", "odc simulate"), ("compare", "odc compare")):
        result = subprocess.run([odc_cli, command, *lengths, "--plot", ""], capture_output=True,
                                text=True, timeout=60)  # fmt: skip
        assert result.returncode == 2 and result.stdout == "", result.stdout
        assert result.stderr.splitlines() == [f"{program}: error: {message}"], result.stderr
    assert main([*lengths, "--plot", ""]) == 2  # python -m odc.simulate passes it through
    assert capfd.readouterr().err.splitlines() == [f"odc simulate: error: {message}"]


@pytest.mark.parametrize(
    "module, argv, stdin, message",
    [
        ("simulate", ["x.png"], "[" * 100_000, "stdin is not `odc simulate --format json`: "
                                               "nested too deeply"),
        ("simulate", ["x.png"], '{"results": [1]}', "stdin is not `odc simulate --format json`: "
                                                    "'int' object is not subscriptable"),
        ("simulate", ["x.png"], '{"results": [{}]}', "stdin is not `odc simulate --format json`: "
                                                     "no field 'speedup'"),
        ("simulate", ["x.png"], '{"rows": []}', "stdin is not `odc simulate --format json`: "
                                                "no field 'results'"),
        ("compare_plot", ["x.png"], '{"policies": [{}]}', "stdin is not `odc compare --format "
                                                          "json`: no field 'policy'"),
        ("simulate", [""], '{"results": []}', "the plot's file name is empty (usage: python -m "
                                              "odc.simulate --draw FILE.png [TITLE] < "
                                              "simulate.json)"),
    ],
)  # fmt: skip
def test_drawer_input_errors_are_one_line(
    tmp_path, capsys, monkeypatch, module, argv, stdin, message
):
    # Each was a traceback (RecursionError, TypeError, KeyError), or for '' a file named '.png'.
    import io

    from odc import compare_plot, simulate

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    if module == "simulate":
        status, program = simulate.main(["--draw", *argv]), "odc.simulate"
    else:
        status, program = compare_plot.main(argv), "odc.compare_plot"
    assert status == 2
    assert capsys.readouterr().err.splitlines() == [f"{program}: error: {message}"]
    assert list(tmp_path.iterdir()) == []


def _captured_figure(monkeypatch, draw, document):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda f, *a, **k: figures.append(f))
    draw(document, "unused.png")
    (figure,) = figures
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)  # the figure was closed after saving
    canvas.draw()
    return figure, canvas.get_renderer()


def test_plots_keep_lines_apart_and_legends_off_the_data(odc_cli, data_dir, monkeypatch):
    # On one node odc and odc-hybrid coincide: each line needs its own style and
    # marker, and no legend may sit over an axes.
    from odc.compare_plot import draw as draw_compare
    from odc.simulate import draw as draw_simulate

    arguments = ["--lengths", str(data_dir / "aime_rl_like.txt"), "--ranks", "8,16"]
    document = json.loads(
        simulate(odc_cli, *arguments, "--minibatches", "2", "--format", "json").stdout
    )
    figure, renderer = _captured_figure(monkeypatch, draw_simulate, document)
    (axis,) = figure.axes
    styles = [(line.get_linestyle(), line.get_marker()) for line in axis.get_lines()]
    # 5 modes x local-sort and lb-micro, lb-mini under the 3 that run it, lb-mini-padded under
    # the 2 lockstep ones.
    assert len(styles) == 15 and len(set(styles)) == len(styles)
    legend = axis.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(axis.get_window_extent(renderer))
    compare = subprocess.run(
        [odc_cli, "compare", *arguments[:2], "--ranks", "4", "--format", "json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    figure, renderer = _captured_figure(monkeypatch, draw_compare, json.loads(compare.stdout))
    legends = [axis.get_legend() for axis in figure.axes] + figure.legends
    boxes = [legend.get_window_extent(renderer) for legend in legends if legend is not None]
    assert boxes
    for box in boxes:
        assert not any(box.overlaps(axis.get_window_extent(renderer)) for axis in figure.axes)


def test_decision_names_only_arms_that_fit(odc_cli, data_dir):
    # A 14B-like model on 16 x 80 GB GPUs. fsdp2-unsharded (the whole model's
    # bf16 parameters and fp32 gradients on every GPU) and fsdp2-deferred do not fit; the verdict
    # named fsdp2-unsharded the strongest baseline all the same. Now the decision compares ODC
    # with the fastest arm that fits, and its why says which faster arm does not.
    arguments = ["--lengths", str(data_dir / "longalign_like.txt"), "--ranks", "16"]
    arguments += ["--minibatches", "2", "--layers", "48", "--layer-params", "2.9e8"]
    arguments += ["--other-params", "1.5e9", "--cost", "2e-5,1e-10,0.05"]
    document = json.loads(
        simulate(odc_cli, *arguments, "--gpu-memory-gbytes", "80", "--format", "json").stdout
    )
    fits = {row["mode"]: row["fits"] for row in document["memory_per_gpu"]}
    assert fits == {
        "collective": True,
        "fsdp2-deferred": False,
        "fsdp2-unsharded": False,
        "odc": True,
        "odc-hybrid": True,
    }
    # The case: fsdp2-unsharded is fastest but does not fit; never the baseline.
    (strongest,) = document["strongest_baseline"]
    assert strongest["baseline"].split(" + ")[0] == "collective"
    decision = document["decision"]
    assert decision["use_odc"] and decision["baseline"] == strongest["baseline"]
    assert decision["text"].endswith("(80 GB/GPU, --gpu-memory-gbytes)")
    assert "fsdp2-unsharded" not in decision["text"]
    assert " + lb-mini would beat collective + " in decision["reason"]
    assert "but needs 113.94 GB/GPU" in decision["reason"]
    # Only FSDP2 arms: the fastest of them does not fit, and the why says so.
    only_fsdp2 = arguments + ["--modes", "collective,fsdp2-unsharded", "--format", "json"]
    only_fsdp2 += ["--gpu-memory-gbytes", "80"]
    decision = json.loads(simulate(odc_cli, *only_fsdp2).stdout)["decision"]
    assert decision["text"].startswith("decision: use FSDP2 (collective + ")
    assert ": no ODC arm fits" in decision["text"] and decision["use_odc"] is False
    assert "fsdp2-unsharded + lb-mini is faster but needs 113.94 GB/GPU" in decision["reason"]
    # Nothing fits: said, with the smallest state and the rank count from which it fits.
    # (collective: 15.42 GB of state at 16 GPUs plus 10.16 GB gathered: 20 GB fit from 32 GPUs.)
    small_gpu = arguments + ["--gpu-memory-gbytes", "20", "--format", "json"]
    decision = json.loads(simulate(odc_cli, *small_gpu).stdout)["decision"]
    assert decision["text"] == "decision: nothing fits at 16 GPUs (20 GB/GPU, --gpu-memory-gbytes)"
    assert decision["use_odc"] is None and decision["by_ranks"][0]["choice"] == "nothing fits"
    assert decision["reason"] == (
        "why: the smallest state, collective's, needs 25.58 GB/GPU > 20 GB/GPU; "
        "collective's state fits from 32 GPUs"
    )


def test_grpo_phases_and_the_strongest_baseline(odc_cli, data_dir):
    # --task grpo per RL step (two forward-only phases, K updates), the FSDP2
    # arms beside ODC, and the verdict against the fastest of them, through the command and the
    # C API alike.
    arguments = ["--lengths", str(data_dir / "grpo_math_like.txt"), "--ranks", "8"]
    arguments += ["--minibatches", "2", "--task", "grpo", "--minibatches-per-step", "2"]
    command = simulate(odc_cli, *arguments, "--format", "json")
    assert command.returncode == 0, command.stderr
    document = json.loads(command.stdout)
    assert document == simulate_in_process(arguments)
    assert document["task"] == "grpo" and document["minibatches_per_step"] == 2
    rows = {(r["policy"], r["mode"]): r for r in document["results"]}
    # lb-mini-padded under the lockstep modes only, lb-mini under the others only.
    assert ("lb-mini-padded", "fsdp2-deferred") in rows and ("lb-mini", "odc") in rows
    assert ("lb-mini", "collective") not in rows and ("lb-mini-padded", "odc") not in rows
    for row in rows.values():
        phases = row["phases"]
        assert row["step_seconds"] == pytest.approx(
            2 * phases["forward_phase_seconds"] + phases["update_seconds"]
        )
        assert len(row["minibatch_seconds"]) == 2  # one per RL step
        # A forward is a quarter of a microbatch: the forward phases are far shorter.
        assert 0 < phases["forward_phase_seconds"] < phases["update_seconds"]
    # Deferred sync drops reduce-scatters, never adds: never slower than collective.
    for policy in ("local-sort", "lb-micro"):
        deferred, collective = rows[(policy, "fsdp2-deferred")], rows[(policy, "collective")]
        assert deferred["step_seconds"] <= collective["step_seconds"] * (1 + 1e-12)
    (strongest,) = document["strongest_baseline"]
    fits = {row["mode"]: row["fits"] for row in document["memory_per_gpu"]}
    fsdp2 = [r for r in rows.values() if r["mode"] not in ("odc", "odc-hybrid") and fits[r["mode"]]]
    fastest = min(fsdp2, key=lambda r: r["step_seconds"])
    assert strongest["baseline"] == f"{fastest['mode']} + {fastest['policy']}"
    assert strongest["odc_speedup"] == pytest.approx(
        fastest["step_seconds"] / strongest["odc_step_seconds"]
    )
    (decided,) = document["decision"]["by_ranks"]
    assert decided["baseline"] == strongest["baseline"]
    assert decided["gain"] == pytest.approx(strongest["odc_speedup"])
    table = simulate(odc_cli, *arguments)
    assert table.returncode == 0 and "fwd-only" in table.stdout and "unsharded" in table.stdout
    cases = [
        (["--task", "rl"], "unknown task 'rl': expected sft or grpo"),
        (["--task", "grpo", "--split", "auto"], "--task grpo does not split samples yet"),
        (["--task", "grpo", "--samples-per-rank", "1", "--ranks", "3"], "does not split into"),
        (["--policies", "lb-maxi"], "expected local-sort, lb-micro, lb-mini or lb-mini-padded"),
        (["--modes", "collective", "--policies", "lb-mini"], "no arm"),
    ]
    lengths = ["--lengths", str(data_dir / "grpo_math_like.txt")]
    for case, message in cases:
        result = simulate(odc_cli, *lengths, *case)
        assert result.returncode == 2 and message in result.stderr, (case, result.stderr)
