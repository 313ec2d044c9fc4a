# The exit-recording shim in Perl (engine/cron/_shell.py's shim_argv says when it is used: where the C one,
# _shim.c, was not compiled at install time; _shim.py is the same shim in Python, the last fallback). Run as `perl -t _shim.pl EXIT_FILE -- COMMAND [ARGS...]` (-t: no
# PERL5OPT, no PERL5LIB; unlike -T, a PATH that taint mode calls insecure is only a warning, silenced) as
# the leader of the command's process group. It runs COMMAND with default signal dispositions, waits for
# it, writes {"pid", "exit_code" | "signal", "ended_at"} to EXIT_FILE (temp file, fsync, rename), then
# ends the way the command did. It ignores SIGINT, SIGTERM, SIGQUIT and SIGHUP itself (they reach the
# command through the group). The record's blocks are reserved before the command starts (4 KiB of
# spaces, overwritten in place: JSON allows trailing blanks), so a disk filled meanwhile cannot lose it.
# Not a shell: a shell's `wait` says 130 both for `exit 130` and for a death by SIGINT.
# No module but strict before the command starts (each costs milliseconds): the exit path loads IO::Handle
# (fsync; in perl-base) and Time::HiRes (ended_at; not in perl-base: whole seconds without it).
use strict;

sub now { my $now = eval { require Time::HiRes; Time::HiRes::time() }; return defined $now ? $now : time() }

# The shim speaks only through its own messages (print STDERR): no perl warning reaches the watch log.
$SIG{__WARN__} = sub { };

sub untaint { my ($value) = $_[0] =~ /\A(.*)\z/s; return $value }

if (@ARGV < 3 || $ARGV[1] ne '--') {
    print STDERR "usage: _shim.pl EXIT_FILE -- COMMAND [ARGS...]\n";
    exit 2;
}
my ($exit_file, undef, @command) = map { untaint($_) } @ARGV;
$ENV{$_} = untaint($ENV{$_}) for grep { defined $ENV{$_} } qw(PATH IFS CDPATH ENV BASH_ENV);
my @passed_on = qw(INT TERM QUIT HUP);
$SIG{$_} = 'IGNORE' for @passed_on;
my $reserve_bytes = 4096;
my $tmp = "$exit_file.tmp.$$";
my $problem;
my $reserved;
if (open(my $fh, '+>', $tmp)) {
    my $written = syswrite($fh, ' ' x $reserve_bytes);
    if (defined $written && $written == $reserve_bytes) {
        $reserved = $fh;
    } else {
        $problem = "$!";
        close $fh;
    }
} else {
    $problem = "$!";
}

sub say_err { my ($text) = @_; print STDERR "$text\n" }

sub write_record {  # the failure, as a phrase, or undef
    my ($data) = @_;
    require IO::Handle;
    my $fh = $reserved;
    if (defined $fh) {
        sysseek($fh, 0, 0) or return "$!";
        my $written = syswrite($fh, sprintf('%-*s', $reserve_bytes, $data));
        defined $written or return "$!";
    } else {
        open($fh, '>', $tmp) or return "$!";
        my $written = syswrite($fh, $data);
        defined $written && $written == length $data or return $! ? "$!" : 'short write';
    }
    $fh->sync or return "$!";
    close $fh or return "$!";
    rename($tmp, $exit_file) or return "$!";
    my ($folder) = $exit_file =~ m{\A(.*)/[^/]*\z}s;
    $folder = defined $folder ? (length $folder ? $folder : '/') : '.';
    if (open(my $dh, '<', $folder)) { $dh->sync; close $dh }  # fsync the folder (the rename)
    return undef;
}

sub end_as {  # the same signal (re-raised on itself), or the same exit code
    my ($status) = @_;
    if ($status & 127) {
        $SIG{$_} = 'DEFAULT' for @passed_on;
        kill $status & 127, $$;
        exit 128 + ($status & 127);  # a signal that does not end a process by default
    }
    exit $status >> 8;
}

# A pipe closed on exec (perl sets FD_CLOEXEC above fd 2): the child writes to it only if exec failed.
pipe(my $exec_failed, my $tell) or $problem //= "$!";
my $pid = fork();
if (defined $pid && $pid == 0) {
    close $reserved if defined $reserved;
    close $exec_failed if defined $exec_failed;
    $SIG{$_} = 'DEFAULT' for @passed_on, qw(PIPE XFSZ);
    exec { $command[0] } @command;
    print STDERR "cannot run '$command[0]': $!\n";
    syswrite($tell, 'x') if defined $tell;
    eval { require POSIX; POSIX::_exit(127) };
    exit 127;
}
close $tell if defined $tell;
if (!defined $pid || (defined $exec_failed && sysread($exec_failed, my $byte, 1))) {
    say_err("cannot run '$command[0]': $!") if !defined $pid;
    waitpid($pid, 0) if defined $pid;
    write_record(sprintf('{"pid": null, "exit_code": 127, "ended_at": %.6f}', now()));
    exit 127;
}
close $exec_failed if defined $exec_failed;
# (No EINTR to retry: the shim catches no signal. And no `%!` anywhere: it loads Errno, and Config, at
# compile time, which costs milliseconds before the command starts.)
my $status = waitpid($pid, 0) == $pid ? $? : 127 << 8;
my $record = ($status & 127)
    ? sprintf('{"pid": %d, "signal": %d, "ended_at": %.6f}', $pid, $status & 127, now())
    : sprintf('{"pid": %d, "exit_code": %d, "ended_at": %.6f}', $pid, $status >> 8, now());
my $failure = write_record($record);
if (defined $failure) {
    unlink $tmp;
    my $reserve = defined $problem ? "; reserving its space failed too: $problem" : '';
    say_err("gadget-engine: the exit of '$command[0]' could not be recorded ($failure$reserve); "
        . "the shim ends with the command's own status instead");
}
end_as($status);
