# Sourced by the payload scripts: pack_parts BUILD tars BUILD/payload and splits it into
# .dev/c1 .. .dev/cN, one part per device call, each small enough that the call, which also
# carries the working tree, stays under its 64 MiB (half a MiB to spare).
pack_parts() {
    local build=$1 tree part size n i f
    tree=$(git ls-files -z --cached --others --exclude-standard | du --files0-from=- -cb | tail -1 | cut -f1)
    part=$((64 * 1024 * 1024 - tree - 512 * 1024))
    tar cf "$build/payload.tar" -C "$build" payload
    size=$(stat -c %s "$build/payload.tar")
    n=$(( (size + part - 1) / part ))
    split -b "$part" -d -a 2 "$build/payload.tar" "$build/part"
    for i in $(seq 1 "$n"); do
        f=$(printf "part%02d" $((i - 1)))
        mkdir -p ".dev/c$i" && mv "$build/$f" ".dev/c$i/$f"
    done
    rm "$build/payload.tar"
    echo "tree $tree bytes, payload $size bytes in $n calls of at most $part: $(ls -d .dev/c[0-9]* | sort -V | tr '\n' ' ')"
}
