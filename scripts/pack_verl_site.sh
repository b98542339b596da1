#!/usr/bin/env bash
# Packs what dev/gpu/verl_engine_gpu.py imports from .venv-verl and the base .venv lacks (verl and
# the dependencies it pulls in) into build/verl_site/, for a GPU machine that has torch and
# transformers but no verl, no network and no pip (dev/gpu/run.sh's stage verl-gpu: VERL_SITE).
#
#   scripts/pack_verl_site.sh [--python 3.12]  # then carry build/verl_site.tar.xz
#
# Which files: the program runs once in --cpu mode under .venv-verl with Python's import-time log
# on; every module it imported whose file lies in .venv-verl's site-packages, in a top-level
# package .venv does not have, is copied file by file (ray, pandas and pyarrow hold hundreds of
# MiB the program never loads), with the shared libraries those extension modules link to from
# the same site-packages, the small data files of those packages (< 1 MiB: verl's version file,
# schemas, certificates) and their .dist-info (version checks); verl and tensordict whole.
# No __pycache__. Then build/verl_site.tar.xz of it, and both sizes.
#
# --python X.Y (default 3.12, the GPU machine's Python): .venv-verl is this machine's Python 3.11,
# whose compiled modules (ray's _raylet.so, pandas, pyarrow's Python bindings, ...) do not load
# in another Python. Every copied package with compiled files is swapped for the same version's
# wheel for X.Y from the package index (pip download, manylinux x86_64), file for file; a compiled
# file the new wheel lacks stops the script.
#
# Why it holds ray, datasets, pyarrow and pandas (most of its size), none of which the program
# calls: verl 0.9.1 imports them on the way to its FSDP engine. `import verl` runs
# verl/__init__.py, which imports verl.protocol, which imports ray at its top; the engine module
# (verl.workers.engine.fsdp.transformer_impl) imports verl.utils.checkpoint (its __init__ reaches
# verl.single_controller, which imports ray again) and verl.utils.dataset.dataset_utils (the
# package's __init__ imports its RL dataset, which imports datasets, hence pyarrow and pandas).
# No stubs: every module verl imports is the real one, so the GPU run is verl's own code.
set -euo pipefail
cd "$(dirname "$0")/.."
target_python=3.12
case "${1:-}" in
  --python) target_python=${2:?--python needs a version such as 3.12} ;;
  "") ;;
  *) echo "pack_verl_site: unknown argument '$1' (usage: pack_verl_site.sh [--python X.Y])" >&2; exit 2 ;;
esac
verl_python=.venv-verl/bin/python
[ -x "$verl_python" ] || { echo "pack_verl_site: no $verl_python (scripts/setup_verl.sh)" >&2; exit 1; }
dest=build/verl_site
log=$(mktemp)
trap 'rm -f "$log"' EXIT

echo "pack_verl_site: running the program (--cpu) under .venv-verl to see what it imports"
PYTHONPROFILEIMPORTTIME=1 ODC_LIBRARY=${ODC_LIBRARY:-$PWD/build/cmake/libodc.so} \
  PYTHONPATH=$PWD/python "$verl_python" dev/gpu/verl_engine_gpu.py --cpu >/dev/null 2>"$log" ||
  { tail -20 "$log" >&2; echo "pack_verl_site: the --cpu run failed" >&2; exit 1; }

rm -rf "$dest" "$dest.tar.xz"
mkdir -p "$dest"
"$verl_python" - "$log" "$dest" <<'EOF'
import glob, importlib, os, shutil, subprocess, sys, sysconfig

log, dest = sys.argv[1], sys.argv[2]
verl_site = os.path.realpath(sysconfig.get_paths()["purelib"])
base_site = os.path.realpath(glob.glob(".venv/lib/python3*/site-packages")[0])
names = sorted({l.split("|")[-1].strip() for l in open(log) if l.startswith("import time:")})
names = [n for n in names if n and n != "package" and n.split(".")[0] != "odc"]  # "package": the header
sys.path.insert(0, "python")  # odc, as the program imports it
for name in names:  # the same modules, so that each one's file is known
    try:
        importlib.import_module(name)
    except Exception:
        pass  # a module the program met only through a failed, optional import


def top_level(path):
    return os.path.relpath(path, verl_site).split(os.sep)[0]


def in_base(top):
    stem = top.split(".")[0]
    return any(os.path.exists(os.path.join(base_site, stem + ext)) for ext in ("", ".py")) or glob.glob(
        os.path.join(base_site, stem + ".*.so")
    )


# pyarrow's optional features (datasets imports pyarrow.dataset, which tries them): pyarrow imports
# each inside try/except ImportError, as a pyarrow built without them would run. Left out, they
# save 6 MiB of the archive (libarrow_s3, libarrow_substrait); nothing here reads a file with them.
optional = {"pyarrow._s3fs", "pyarrow._gcsfs", "pyarrow._hdfs", "pyarrow._azurefs"}
optional |= {"pyarrow._substrait", "pyarrow.substrait", "pyarrow._dataset_orc", "pyarrow._orc"}
files, tops = set(), set()
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if not path or name in optional:
        continue
    path = os.path.realpath(path)
    if not path.startswith(verl_site + os.sep) or in_base(top_level(path)):
        continue
    files.add(path)
    tops.add(top_level(path))
# Shared libraries the extension modules link to from the same site-packages (pyarrow's libarrow).
for path in [f for f in files if ".so" in os.path.basename(f)]:
    ldd = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    for line in ldd.splitlines():
        parts = line.split("=>")
        if len(parts) == 2 and parts[1].split():
            lib = os.path.realpath(parts[1].split()[0])
            if lib.startswith(verl_site + os.sep):
                files.add(lib)
# verl, tensordict and datasets whole (no __pycache__): their code imports more of itself inside
# functions or where an optional library is present (datasets imports its jax formatter where jax
# is, as on the GPU machine),
# on paths the --cpu run does not take (the packed forward's monkey patch, CUDA branches).
whole = {"verl", "tensordict", "datasets"}
for top in whole & tops:
    for directory, subdirs, names_here in os.walk(os.path.join(verl_site, top)):
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        files.update(os.path.join(directory, n) for n in names_here if not n.endswith(".pyc"))
for top in tops:  # small data files and the metadata of each copied package
    root = os.path.join(verl_site, top)
    for directory, subdirs, names_here in os.walk(root) if os.path.isdir(root) else ():
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        for n in names_here:
            path = os.path.join(directory, n)
            code = n.endswith((".py", ".pyc", ".pyi", ".so", ".pyx", ".pxd", ".h", ".cpp"))
            if not code and ".so." not in n and os.path.getsize(path) < 2**20:
                files.add(path)
    for info in glob.glob(os.path.join(verl_site, top.split(".")[0].replace("-", "_") + "-*.dist-info")):
        for directory, _, names_here in os.walk(info):
            files.update(os.path.join(directory, n) for n in names_here)
# Packages whose modules live in other top-level names (attrs for attr, ...): their dist-info.
for info in glob.glob(os.path.join(verl_site, "*.dist-info")):
    top_file = os.path.join(info, "top_level.txt")
    if os.path.exists(top_file) and set(open(top_file).read().split()) & tops:
        for directory, _, names_here in os.walk(info):
            files.update(os.path.join(directory, n) for n in names_here)
for path in files:
    target = os.path.join(dest, os.path.relpath(path, verl_site))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy2(path, target)
print("pack_verl_site: packages copied:", " ".join(sorted(t for t in tops)))
EOF
"$verl_python" - "$dest" "$target_python" <<'EOF'
import importlib.metadata as metadata, os, shutil, subprocess, sys, sysconfig, tempfile, zipfile

dest, target = sys.argv[1], sys.argv[2]
here_tag = "cpython-%d%d" % sys.version_info[:2]
target_tag = "cpython-" + target.replace(".", "")
if target_tag == here_tag:
    sys.exit(0)
site = os.path.realpath(sysconfig.get_paths()["purelib"])
owned = {}  # distribution -> the copied files it installed (namespaces such as google/ are shared)
for dist in metadata.distributions(path=[site]):
    for entry in dist.files or ():
        if os.path.isfile(os.path.join(dest, str(entry))):
            owned.setdefault(dist, []).append(str(entry))
for dist, copied in sorted(owned.items(), key=lambda item: item[0].metadata["Name"]):
    if not any(".so" in os.path.basename(f) for f in copied):
        continue
    name, version = dist.metadata["Name"], dist.version
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", target, "--implementation", "cp", "--platform",
             "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform",
             "manylinux2014_x86_64", "-d", wheels, f"{name}=={version}"],
            check=True,
        )
        [wheel] = [os.path.join(wheels, w) for w in os.listdir(wheels) if w.endswith(".whl")]
        with zipfile.ZipFile(wheel) as archive:
            inside = set(archive.namelist())
            for old in copied:
                member = old.replace(here_tag, target_tag)
                if member not in inside:
                    if ".so" in os.path.basename(old):
                        sys.exit(f"pack_verl_site: {name} {version}'s wheel for Python "
                                 f"{target} has no {member}")
                    continue  # metadata this install wrote (RECORD, INSTALLER): kept
                os.remove(os.path.join(dest, old))
                with archive.open(member) as source, open(os.path.join(dest, member), "wb") as out:
                    shutil.copyfileobj(source, out)
                if ".so" in os.path.basename(old):
                    os.chmod(os.path.join(dest, member), 0o755)
    print(f"pack_verl_site: {name} {version} from {os.path.basename(wheel)}")
EOF
XZ_OPT=-9 tar -C build -cJf "$dest.tar.xz" verl_site
echo "pack_verl_site: $dest/ $(du -sm "$dest" | cut -f1) MiB; $dest.tar.xz" \
  "$(du -m "$dest.tar.xz" | cut -f1) MiB ($(du -b "$dest.tar.xz" | cut -f1) bytes)"
