# Sourced by the dev/gpu scripts: `stage NAME TIMEOUT COMMAND...` runs a command with a time
# limit, appends its output to "$log", says how it ended, and on failure sets status=1 and goes
# on (one failed stage must not cost the device minutes of the others).
stage() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S)): $*" | tee -a "$log"
  local rc=0 begin=$SECONDS
  # timeout signals its whole process group, so torchrun's and odc.launch's ranks go too.
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "=== $name FAILED (exit $rc) after $((SECONDS - begin)) s" | tee -a "$log"
    status=1
  else
    echo "=== $name done in $((SECONDS - begin)) s" | tee -a "$log"
  fi
}
