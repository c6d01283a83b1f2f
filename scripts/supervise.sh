# The workers' supervision, shared by launch.sh and scripts/join.sh (sourced, not run). Expects
# WORKER_PID (an associative array: worker number -> pid), start_worker N and say.

stop_workers() {  # SIGTERM: each finishes, or gives back, the job in hand; SIGKILL after 30 s
    local pids=("${WORKER_PID[@]}")
    kill -TERM "${pids[@]}" 2>/dev/null
    for _ in $(seq 1 300); do
        kill -0 "${pids[@]}" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null
    wait "${pids[@]}" 2>/dev/null
}

restart_dead_workers() {  # one pass: a worker that exited is started again (its job returns through recovery)
    local i status why
    for i in "${!WORKER_PID[@]}"; do
        if ! kill -0 "${WORKER_PID[$i]}" 2>/dev/null; then
            wait "${WORKER_PID[$i]}"; status=$?
            why=""; [ "$status" -eq 3 ] && why=", its GPU failed"  # worker.loop.EXIT_DEVICE_BROKEN
            say "worker $i (pid ${WORKER_PID[$i]}) exited with status $status$why: restarting it (its job returns through recovery)"
            start_worker "$i"
        fi
    done
}
