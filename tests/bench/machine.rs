//! What the numbers were measured on.

fn first_line(path: &str, key: &str) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_string())
        .unwrap_or_default()
}

pub fn describe() -> serde_json::Value {
    serde_json::json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": first_line("/proc/cpuinfo", "model name"),
        "memory": first_line("/proc/meminfo", "MemTotal"),
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        "load_average": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
        "runtime": "tokio multi-thread, one worker per CPU (as src/main.rs)",
    })
}
