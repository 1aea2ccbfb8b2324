"""Stand-in commands for tests of scripts the nodes run: bash bodies found first on PATH. The block-device
tools (blkid, mdadm, mkfs.xfs, mount, findmnt, udevadm) serve the scratch program's tests on this machine and
the plain-Ubuntu shaped node (tests/shaped/ubuntu.py), whose kernel has no md driver."""

from __future__ import annotations

import os
from pathlib import Path


def stand_in_commands(tmp_path: Path, **scripts: str) -> dict[str, str]:
    """An environment whose PATH finds these stand-in commands (name -> bash body) first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def block_device_stand_ins(state: Path, sysfs: Path, host_name: str) -> dict[str, str]:
    """Bash bodies of the stand-in tools. A device's signatures are the file state/dev/NAME (blkid's
    export lines; no file: blank), its holders the entries of the sys tree's holders directory, the
    mount table state/mounts ("SOURCE TARGET" lines); every call is appended to state/calls. mdadm names an
    array's members host_name:NAME, as it names them after the host it runs on."""
    log = f'echo "${{0##*/}} $*" >> {state}/calls'
    signature = f'sig() {{ local f={state}/dev/${{1##*/}}; if [ -s "$f" ]; then cat "$f"; fi; }}'
    held = f'held() {{ [ -n "$(ls {sysfs}/sys/class/block/${{1##*/}}/holders 2>/dev/null)" ]; }}'
    hold = f'hold() {{ mkdir -p {sysfs}/sys/class/block/${{1##*/}}/holders/md127; }}'
    return {
        "blkid": f"""{log}
{signature}
dev=${{@: -1}}
if [ -z "$(sig "$dev")" ]; then exit 2; fi
echo "DEVNAME=$dev"; sig "$dev"
""",
        "mdadm": f"""{log}
{signature}
{held}
{hold}
mode=$1; array=$2; shift 2
name="" run=no devices=()
for arg in "$@"; do
    case "$arg" in
        --name=*) name=${{arg#--name=}} ;;
        --run) run=yes ;;
        /dev/*) devices+=("$arg") ;;
    esac
done
for dev in "${{devices[@]}}"; do
    if held "$dev"; then echo "mdadm: cannot open $dev: Device or resource busy" >&2; exit 1; fi
done
if [ "$mode" = --assemble ]; then
    for dev in "${{devices[@]}}"; do
        if ! sig "$dev" | grep -q "^LABEL=.*:${{array##*/}}$"; then
            echo "mdadm: no recogniseable superblock on $dev" >&2; exit 1
        fi
    done
    for dev in "${{devices[@]}}"; do hold "$dev"; done
    echo "mdadm: $array has been started with ${{#devices[@]}} drives." >&2
    exit 0
fi
# --create: mdadm's own look at the devices (check_ext2, check_raid, check_partitions): it does not
# see XFS or LVM
warn=no
for dev in "${{devices[@]}}"; do
    case "$(sig "$dev")" in
        *TYPE=ext[234]*) echo "mdadm: $dev appears to contain an ext2fs file system" >&2; warn=yes ;;
        *TYPE=linux_raid_member*) echo "mdadm: $dev appears to be part of a raid array:" >&2; warn=yes ;;
        *PTTYPE=*) echo "mdadm: partition table exists on $dev" >&2; warn=yes ;;
    esac
done
if [ "$warn" = yes ] && [ "$run" = no ]; then
    printf 'Continue creating array? ' >&2
    if ! read -r answer || [[ "$answer" != [yY]* ]]; then echo "mdadm: create aborted." >&2; exit 1; fi
fi
for dev in "${{devices[@]}}"; do
    printf 'TYPE=linux_raid_member\\nLABEL={host_name}:%s\\n' "$name" > {state}/dev/${{dev##*/}}
    hold "$dev"
done
rm -f {state}/dev/md127
echo "mdadm: array $array started." >&2
""",
        "mkfs.xfs": f"""{log}
{signature}
{held}
label=""
while [ $# -gt 1 ]; do
    case "$1" in -L) label=$2; shift ;; esac
    shift
done
dev=$1
if held "$dev"; then echo "mkfs.xfs: cannot open $dev: Device or resource busy" >&2; exit 1; fi
found=$(sig "$dev" | sed -n 's/^TYPE=//p')
if [ -n "$found" ]; then
    echo "mkfs.xfs: $dev appears to contain an existing filesystem ($found)." >&2
    echo "mkfs.xfs: Use the -f option to force overwrite." >&2
    exit 1
fi
printf 'TYPE=xfs\\n%s\\n' "${{label:+LABEL=$label}}" > {state}/dev/${{dev##*/}}
""",
        "mount": f"""{log}
{signature}
dev=${{@: -2:1}}; target=${{@: -1}}
if [ "$1" = --bind ]; then
    # a bind mount shows the source of the file system mounted at the directory bound
    source=$(awk -v t="$dev" '$2 == t {{ s = $1 }} END {{ print s }}' {state}/mounts)
    echo "${{source:-/dev/root}} $target" >> {state}/mounts
    exit 0
fi
if ! sig "$dev" | grep -q '^TYPE=xfs$'; then
    echo "mount: $target: wrong fs type, bad option, bad superblock on $dev." >&2; exit 32
fi
echo "$dev $target" >> {state}/mounts
""",
        "findmnt": f"""{log}
touch {state}/mounts
if [ "$1" = --json ]; then
    # the root file system, then the mount table
    awk 'BEGIN {{ printf "{{\\"filesystems\\": [{{\\"target\\": \\"/\\", \\"source\\": \\"/dev/root\\"}}" }}
         {{ printf ", {{\\"target\\": \\"%s\\", \\"source\\": \\"%s\\"}}", $2, $1 }}
         END {{ print "]}}" }}' {state}/mounts
    exit 0
fi
target=${{@: -1}}
# every file system mounted there, the topmost last (--first-only: the first)
first=no
if [[ " $* " == *" --first-only "* ]]; then first=yes; fi
awk -v t="$target" -v first=$first '$2 == t {{ print $1; found = 1; if (first == "yes") exit }}
    END {{ exit !found }}' {state}/mounts
""",
        "udevadm": log,
    }
