"""The sanitizer sweep's reading of compute-sanitizer logs (benchmarks/gpu_sanitizer.py):
what it counts as an error, what it excuses, and that its records are valid result records."""
import importlib.util
from pathlib import Path

from nbattn.perf.results import write_suite, load_suite

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_sanitizer.py"
spec = importlib.util.spec_from_file_location("gpu_sanitizer", PATH)
S = importlib.util.module_from_spec(spec)
spec.loader.exec_module(S)

PROBE = ('========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" '
         'on CUDA API call to cuGetProcAddress_v2.\n')
LAUNCH = ('========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" '
          'on CUDA API call to cuLaunchKernel.\n')
READ = "========= Invalid __global__ read of size 16 bytes\n"


def log(*lines, n=None, family="decode_tc"):
    n = len(lines) if n is None else n
    return "".join(lines) + f"family {family}: done\n========= ERROR SUMMARY: {n} errors\n"


def test_probes_are_excused_and_other_errors_count(tmp_path):
    clean = S.record("decode_tc", "memcheck", log(PROBE, PROBE), 0, 1.0)
    assert clean["value"] == 0 and clean["peers"]["api_probes"] == 2
    assert clean["case"]["api_errors"] == ["cuGetProcAddress_v2: CUDA_ERROR_INVALID_VALUE x2"]
    bad_launch = S.record("decode_tc", "memcheck", log(PROBE, LAUNCH), 0, 1.0)
    assert bad_launch["value"] == 1 and "log_tail" in bad_launch["case"]
    bad_read = S.record("decode_tc", "memcheck", log(PROBE, READ), 0, 1.0)
    assert bad_read["value"] == 1
    # more errors than were printed: none of them is excused
    many = S.record("decode_tc", "memcheck", log(PROBE, n=S.PRINT_LIMIT + 1), 0, 1.0)
    assert many["value"] == S.PRINT_LIMIT + 1
    recs = [clean, bad_launch, bad_read, many]
    write_suite("sanitizer", recs, gpu="fake", command="test", root=tmp_path)
    assert len(load_suite("sanitizer", root=tmp_path).records) == 4


def test_racecheck_hazards_and_failed_children():
    race = S.record("cascade", "racecheck", "family cascade: done\n========= RACECHECK SUMMARY: "
                    "3 hazards displayed (1 error, 2 warnings)\n", 0, 1.0)
    assert race["value"] == 1 and race["peers"]["hazards"] == 3
    unfinished = S.record("cascade", "synccheck", "========= ERROR SUMMARY: 0 errors\n", 1, 1.0)
    assert unfinished["value"] == -1 and not unfinished["case"]["child_completed"]
    no_summary = S.record("cascade", "initcheck", "family cascade: done\n", 0, 1.0)
    assert no_summary["value"] == -1
