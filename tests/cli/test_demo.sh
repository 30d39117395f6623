#!/usr/bin/env bash
# qkv demo: the worked example prints a T×T α whose rows sum to 1, reproduces itself byte for byte
# from a seed, takes UTF-8 (CJK) tokens, refuses 0 or more than 64 tokens with exit code 2, walks
# the four steps with --explain, colours only when asked or on a terminal, saves its arrays with
# numpy lines that recompute α from them, scores additively with --score additive, and fits every
# line it prints to COLUMNS (prose wrapped, tables and the heatmap cut to what fits).
set -uo pipefail

# shellcheck source=harness.sh
source "$(dirname "${BASH_SOURCE[0]}")/harness.sh"

# Runs qkv with NO_COLOR set; stdout to $tmp/out, stderr to $tmp/err, the exit code to $rc.
run() {
  NO_COLOR=1 "$QKV_BIN" "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
}

# The rows of the α table: indent, a token, T values and their sum, all with 3 decimals.
alpha_rows() {
  local t=$1
  grep -E "^   [^ ]+( +[0-9]\.[0-9]{3}){$((t + 1))}\$" "$tmp/out"
}

# Every row of the α table sums to 1.000, and there are exactly T of them.
check_alpha() {
  local what=$1 t=$2 rows sums
  rows=$(alpha_rows "$t" | wc -l)
  [[ $rows -eq $t ]] || fail "$what: expected $t rows of α with their sums, found $rows"
  sums=$(alpha_rows "$t" | awk '{ print $NF }' | sort -u)
  [[ $sums == "1.000" ]] || fail "$what: row sums are not all 1.000: $(echo "$sums" | tr '\n' ' ')"
}

run demo
[[ $rc -eq 0 ]] || fail "qkv demo exited $rc: $(cat "$tmp/err")"
check_alpha "qkv demo" 6
grep -q "heatmap of α" "$tmp/out" || fail "qkv demo: no heatmap"
grep -q "scale: 0.000 \[ ░▒▓█\]" "$tmp/out" || fail "qkv demo: no shade legend under the heatmap"
grep -q "qkv attend --help" "$tmp/out" || fail "qkv demo: no hint of what to try next"
if grep -q $'\x1b' "$tmp/out"; then fail "qkv demo: escape codes in piped output with NO_COLOR"; fi
cp "$tmp/out" "$tmp/seed0"

run demo --seed 0
cmp -s "$tmp/out" "$tmp/seed0" || fail "qkv demo --seed 0 differs from the default run (seed 0)"
run demo
cmp -s "$tmp/out" "$tmp/seed0" || fail "two runs of qkv demo differ"
run demo --seed 1
[[ $rc -eq 0 ]] || fail "qkv demo --seed 1 exited $rc"
check_alpha "qkv demo --seed 1" 6
cmp -s "$tmp/out" "$tmp/seed0" && fail "qkv demo --seed 1 prints the same as seed 0"

run demo --tokens "我 阅读 书"
[[ $rc -eq 0 ]] || fail "qkv demo --tokens (CJK) exited $rc: $(cat "$tmp/err")"
check_alpha "qkv demo --tokens (CJK)" 3
grep -q "阅读" "$tmp/out" || fail "qkv demo --tokens (CJK): the labels are missing"

run demo --tokens "  one  "
[[ $rc -eq 0 ]] || fail "qkv demo --tokens with one token exited $rc"
check_alpha "qkv demo --tokens (one token)" 1

run demo --tokens ""
[[ $rc -eq 2 ]] || fail "qkv demo --tokens '' exited $rc, expected 2"
grep -q -- "--tokens: expected 1 to 64 tokens" "$tmp/err" ||
  fail "qkv demo --tokens '': unclear message: $(cat "$tmp/err")"

sixty_four=$(printf 't%d ' $(seq 1 64))
COLUMNS=1000 run demo --tokens "$sixty_four"
[[ $rc -eq 0 ]] || fail "qkv demo with 64 tokens exited $rc"
check_alpha "qkv demo with 64 tokens (COLUMNS=1000)" 64
run demo --tokens "$sixty_four t65"
[[ $rc -eq 2 ]] || fail "qkv demo with 65 tokens exited $rc, expected 2"
grep -q "got 65" "$tmp/err" || fail "qkv demo with 65 tokens: the message does not say how many came: $(cat "$tmp/err")"

# The widest line of $tmp/out, in terminal columns (CJK two, escapes none).
widest() {
  /usr/bin/python3 -c '
import re, sys, unicodedata
text = re.sub("\x1b\\[[0-9;]*m", "", open(sys.argv[1], encoding="utf-8").read())
print(max(sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
              for c in line) for line in text.splitlines()))' "$tmp/out"
}

# Everything the demo prints fits the terminal: prose wraps, tables and the heatmap show what fits.
mkdir -p "$tmp/w"
for width in 80 60 40; do
  COLUMNS=$width run demo --explain --out-dir "$tmp/w"
  [[ $rc -eq 0 ]] || fail "COLUMNS=$width qkv demo --explain exited $rc"
  [[ $(widest) -le $width ]] || fail "COLUMNS=$width qkv demo --explain: a line is $(widest) columns wide"
  COLUMNS=$width run demo --score additive --explain --out-dir "$tmp/w"
  [[ $(widest) -le $width ]] || fail "COLUMNS=$width qkv demo --score additive --explain: a line is $(widest) wide"
done
thirty=$(printf '阅读%d ' $(seq 1 30))
COLUMNS=80 run demo --tokens "$thirty" --explain --color always
[[ $rc -eq 0 ]] || fail "qkv demo with 30 tokens exited $rc"
[[ $(widest) -le 80 ]] || fail "qkv demo with 30 CJK tokens: a line is $(widest) columns wide at COLUMNS=80"
grep -q "(columns 0–[0-9]* of 30 shown to fit 80 columns" "$tmp/out" ||
  fail "qkv demo with 30 tokens: no line saying which columns of α are shown"
grep -q "(keys 0–[0-9]* of 30 shown\|(fitted to 80 columns" "$tmp/out" ||
  fail "qkv demo with 30 tokens: the heatmap does not say how it was fitted"

run demo --explain
[[ $rc -eq 0 ]] || fail "qkv demo --explain exited $rc"
for step in "1. project: X \[6, 32\] · W_Qᵀ \[32, 32\] → Q \[6, 32\]" "2. score: e = Q Kᵀ / √32" \
  "3. normalise: α = softmax\(e\)" "Why divide by √d" "4. weigh: out = α V"; do
  grep -qE "$step" "$tmp/out" || fail "qkv demo --explain: missing \"$step\""
done
check_alpha "qkv demo --explain" 6

# Colour only when asked for (stdout here is a file, never a terminal).
"$QKV_BIN" demo >"$tmp/out" 2>&1
if grep -q $'\x1b' "$tmp/out"; then fail "qkv demo: escape codes when stdout is not a terminal"; fi
"$QKV_BIN" demo --color always >"$tmp/out" 2>&1
grep -q $'\x1b\[48;' "$tmp/out" || fail "qkv demo --color always: no background colours"

run demo --color sometimes
[[ $rc -eq 2 ]] || fail "qkv demo --color sometimes exited $rc, expected 2"

# The arrays are saved with the pictures, and the printed numpy lines recompute α from them.
mkdir -p "$tmp/d"
run demo --out-dir "$tmp/d"
[[ $rc -eq 0 ]] || fail "qkv demo --out-dir exited $rc: $(cat "$tmp/err")"
for name in X W_Q W_K W_V Q K V alpha; do
  [[ -s "$tmp/d/attention_arrays/$name.npy" ]] || fail "qkv demo saved no attention_arrays/$name.npy"
done
check_snippet() {
  local what=$1 snippet
  snippet=$(sed -n '/^α again, with numpy/,/^$/p' "$tmp/out" | grep '^  ' | sed 's/^  //')
  [[ -n $snippet ]] || { fail "$what: no numpy lines to recompute α"; return; }
  if ! (cd "$tmp/d" && /usr/bin/python3 -c "$snippet" >"$tmp/snippet" 2>&1); then
    fail "$what: the printed numpy lines fail: $(cat "$tmp/snippet")"
    return
  fi
  /usr/bin/python3 -c "import sys; sys.exit(0 if float(open('$tmp/snippet').read()) < 1e-6 else 1)" ||
    fail "$what: the numpy lines do not give the saved α: $(cat "$tmp/snippet")"
}
check_snippet "qkv demo"

# Additive (Bahdanau) scoring on the same sentence: other weights, rows still summing to 1.
run demo --score additive --out-dir "$tmp/d"
[[ $rc -eq 0 ]] || fail "qkv demo --score additive exited $rc: $(cat "$tmp/err")"
check_alpha "qkv demo --score additive" 6
grep -q "additive scoring" "$tmp/out" || fail "qkv demo --score additive does not say how it scored"
for name in W_a U_a w; do
  [[ -s "$tmp/d/attention_arrays/$name.npy" ]] || fail "qkv demo --score additive saved no $name.npy"
done
check_snippet "qkv demo --score additive"
run demo --score additive --explain --no-files
grep -q "2. score (additive, Bahdanau): e_ij = w·tanh(W_a q_i + U_a k_j)" "$tmp/out" ||
  fail "qkv demo --score additive --explain: no additive step 2"
grep -q "Why divide by √d" "$tmp/out" && fail "qkv demo --score additive --explain explains a √d it does not use"
run demo --score cosine
[[ $rc -eq 2 ]] || fail "qkv demo --score cosine exited $rc, expected 2"

finish test_demo
