#!/bin/bash
# The C++ sources are as clang-format (.clang-format at the root) would write them: a style check,
# so that formatting never shows up as noise in a change. Usage: check_format.sh SOURCE_DIR
set -euo pipefail
cd "$1"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  files=$(git ls-files '*.cpp' '*.hpp' '*.h')
else
  files=$(find include src apps tests bench examples \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' \) -not -path '*/node_modules/*')
fi
# shellcheck disable=SC2086
clang-format --dry-run --Werror $files
echo "clang-format: $(echo "$files" | wc -w) files formatted"
