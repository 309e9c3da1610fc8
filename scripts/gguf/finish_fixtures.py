"""Last step of device-make-fixtures.sh: lays out testdata/gguf/ from the work folder and writes
its MANIFEST.txt (files, sizes, sha256, the KL table, per-tensor types, tool versions).
  python3 finish_fixtures.py WORK DEST [--info toolinfo.txt]     (gguf-py on PYTHONPATH)
WORK holds fx/ (make_fixtures.py's output), gguf/<arch>/ (GGUF files with their .llama.json),
gguf/dequant/. DEST is the testdata/gguf folder to fill.
"""
import argparse, glob, json, os, shutil, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_manifest  # noqa: E402

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"]
# The GGUF types committed per architecture (the other archs' BF16 GGUFs are only converter
# inputs for llama-quantize: over 1 MB, not committed).
COMMIT = {"qwen3_moe": ["F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q5_0",
                        "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_M"],
          "qwen2_moe": ["Q8_0", "Q4_K_M", "IQ3_XXS"],
          "mixtral": ["Q8_0", "Q4_K_M", "IQ3_XXS"],
          "glm4_moe": ["Q8_0", "Q4_K_M", "IQ3_XXS"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("dest")
    ap.add_argument("--info", default=None)
    ap.add_argument("--interim", action="store_true",
                    help="host-made INTERIM set: reference.json (llama.cpp on F32) instead of config.json + golden.json")
    a = ap.parse_args()
    W, D = a.work, a.dest
    os.makedirs(D, exist_ok=True)
    missing = []

    # shared tokenizer golden, with llama.cpp's ids (from qwen3_moe-Q8_0) beside transformers'
    gt = json.load(open(os.path.join(W, "fx", "fixtures", "golden_tokenize.json")))
    tok_rows = {}
    for arch in ARCHS:
        for f in sorted(glob.glob(os.path.join(W, "gguf", arch, "**", "*.llama.summary.json"), recursive=True)):
            s = json.load(open(f))
            if s.get("llama_tokenize") is not None:
                tok_rows[s["file"]] = s["llama_tokenize"]
    ref = tok_rows.get("qwen3_moe-Q8_0.gguf")
    if ref is not None:
        for c, l in zip(gt["cases"], ref):
            c["llama_ids"] = l["ids"]
            c["llama_matches_hf"] = l["ids"] == c["ids"]
        gt["llama_ids_from"] = "llama.cpp (ik_llama.cpp) llama_tokenize(add_special=false, parse_special=true) on qwen3_moe/qwen3_moe-Q8_0.gguf"
        gt["llama_ids_same_in_all_files"] = all(v == ref for v in tok_rows.values())
    json.dump(gt, open(os.path.join(D, "golden_tokenize.json"), "w"), ensure_ascii=False, indent=1)

    files = []
    for arch in ARCHS:
        fd = os.path.join(W, "fx", "fixtures", arch)
        dd = os.path.join(D, arch)
        os.makedirs(dd, exist_ok=True)
        for fn in (("tokenizer.json", "tokenizer_config.json", "reference.json") if a.interim else
                   ("config.json", "tokenizer.json", "tokenizer_config.json", "golden.json")):
            if os.path.exists(os.path.join(fd, fn)):
                shutil.copy(os.path.join(fd, fn), dd)
            else:
                missing.append(f"{arch}/{fn}")
        for t in COMMIT[arch]:
            src = os.path.join(W, "gguf", arch, f"{arch}-{t}.gguf")
            for s in (src, src + ".llama.json"):
                if os.path.exists(s):
                    shutil.copy(s, dd)
                else:
                    missing.append(os.path.relpath(s, W))
            files.append(os.path.join(dd, f"{arch}-{t}.gguf"))
        imat = os.path.join(W, "gguf", arch, f"{arch}.imatrix")
        if os.path.exists(imat):
            shutil.copy(imat, dd)
        sd = os.path.join(W, "gguf", arch, "split")
        if os.path.isdir(sd):
            shutil.copytree(sd, os.path.join(dd, "split"), dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.summary.json", "*.log"))
            files += sorted(glob.glob(os.path.join(dd, "split", "*.gguf")))
    dq = os.path.join(W, "gguf", "dequant")
    if os.path.isdir(dq):
        shutil.copytree(dq, os.path.join(D, "dequant"), dirs_exist_ok=True)

    # KL table over every file that has a .llama.json (committed or not)
    rows = {}
    for f in sorted(glob.glob(os.path.join(W, "gguf", "*", "**", "*.llama.json"), recursive=True)):
        r = json.load(open(f))
        arch = os.path.relpath(f, os.path.join(W, "gguf")).split(os.sep)[0]
        name = os.path.basename(f)[:-len(".llama.json")]
        typ = name[len(arch) + 1:-len(".gguf")]
        rows[(arch, typ)] = r
    types = []
    for (arch, typ) in rows:
        if typ not in types:
            types.append(typ)
    order = ["BF16", "F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q4_K_M", "Q4_0", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_M"]
    types.sort(key=lambda t: (order.index(t) if t in order else len(order), t))
    ref = "llama.cpp on the F32 GGUF (INTERIM)" if a.interim else "transformers fp32"
    lines = [f"KL(softmax({ref}) || softmax(llama.cpp on the file)), nats: mean over all golden positions / max;"
             f" argmax agreement with {ref}",
             "| type | " + " | ".join(ARCHS) + " |", "|---|" + "---|" * len(ARCHS)]
    for t in types:
        cells = []
        for arch in ARCHS:
            r = rows.get((arch, t))
            cells.append("" if r is None else f"{r['kl_mean']:.2e} / {r['kl_max']:.2e} / {100 * r['argmax_agreement']:.0f}%")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    mism = {f"{k[0]}-{k[1]}": sorted(m["text"] for m in v.get("tokenize_mismatches", [])) for k, v in rows.items()}
    n_cases = len(gt["cases"])
    lines.append("")
    if not any(mism.values()):
        lines.append(f"llama.cpp's tokenization == tokenizer.json's (Hugging Face tokenizers) for all {n_cases} tokenizer cases, in every file")
    else:
        sets = {json.dumps(v, ensure_ascii=False) for v in mism.values()}
        if len(sets) == 1:
            lines.append(f"llama.cpp's tokenization differs from tokenizer.json's (Hugging Face tokenizers), in every file, for "
                         f"{len(next(iter(mism.values())))} of {n_cases} tokenizer cases: {sets.pop()} (see golden_tokenize.json)")
        else:
            for k, v in sorted(mism.items()):
                lines.append(f"{k}: tokenization differs for {json.dumps(v, ensure_ascii=False)}")
    kl_table = "\n".join(lines)
    open(os.path.join(W, "kl_table.md"), "w").write(kl_table + "\n")

    out = ["# testdata/gguf MANIFEST (generated by scripts/gguf/finish_fixtures.py; see README.md)", ""]
    if a.info and os.path.exists(a.info):
        out += ["## Tools", open(a.info).read().rstrip(), ""]
    out += [f"## llama.cpp on each file vs {ref}", kl_table, ""]
    if missing:
        out += ["## MISSING (a step failed)"] + missing + [""]
    all_files = sorted(glob.glob(os.path.join(D, "**", "*"), recursive=True))
    total = sum(os.path.getsize(f) for f in all_files if os.path.isfile(f))
    out += [f"## Files ({total} bytes in all)"]
    for f in all_files:
        if os.path.isfile(f):
            out.append(f"{os.path.getsize(f):>10}  {os.path.relpath(f, D)}")
    out += ["", "## GGUF files: metadata and per-tensor types (gguf-py)"]
    import io, contextlib
    for f in files:
        if not os.path.exists(f):
            continue
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            sys.argv = ["gguf_manifest.py", "--root", D, f]
            gguf_manifest.main()
        out.append(buf.getvalue().rstrip())
    open(os.path.join(D, "MANIFEST.txt"), "w").write("\n".join(out) + "\n")
    print(kl_table)
    if missing:
        print("MISSING:", missing)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
